// The core's one kernel: a batch of copies within a GPU's memory (a fusion buffer's pack
// or unpack), as PTX text. The driver compiles it for the GPU at hand when the core first
// loads it (cuModuleLoadData), so building the core needs no CUDA compiler.
//
// hvdlite_copy_batch(table, count): table points to `count` entries in device memory,
// each {dst, src, bytes} as three u64; block b copies entries b, b + gridDim.x, ... with
// its threads side by side: 16 bytes at a time where dst, src and bytes are all multiples
// of 16, else 4 bytes at a time where they are multiples of 4, else byte by byte. The
// copies must not overlap.
#pragma once

namespace hvdlite {
namespace gpu {

constexpr const char* kCopyBatchEntry = "hvdlite_copy_batch";
constexpr int kCopyBatchThreads = 256;
constexpr int kCopyBatchMaxBlocks = 4096;

// The headers tried in turn: a CUDA 13 driver compiles for Turing (sm_75) and later
// only, an older one may lack ISA 6.4 but takes sm_50.
constexpr const char* kCopyBatchHeaders[] = {".version 6.4\n.target sm_75\n", ".version 6.0\n.target sm_50\n"};

constexpr const char* kCopyBatchPtx = R"PTX(
.address_size 64

.visible .entry hvdlite_copy_batch(
    .param .u64 p_table,
    .param .u32 p_count)
{
    .reg .pred %p<8>;
    .reg .b32 %r<16>;
    .reg .b64 %rd<32>;

    ld.param.u64 %rd1, [p_table];
    ld.param.u32 %r1, [p_count];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %nctaid.x;
    mov.u32 %r4, %tid.x;
    mov.u32 %r5, %ntid.x;
    cvt.u64.u32 %rd20, %r4;
    cvt.u64.u32 %rd21, %r5;
ENTRY:
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra DONE;
    mul.wide.u32 %rd2, %r2, 24;
    add.u64 %rd3, %rd1, %rd2;
    ld.global.u64 %rd4, [%rd3];
    ld.global.u64 %rd5, [%rd3+8];
    ld.global.u64 %rd6, [%rd3+16];
    cvta.to.global.u64 %rd4, %rd4;
    cvta.to.global.u64 %rd5, %rd5;
    or.b64 %rd7, %rd4, %rd5;
    or.b64 %rd7, %rd7, %rd6;
    and.b64 %rd8, %rd7, 15;
    setp.eq.u64 %p2, %rd8, 0;
    @%p2 bra WIDE;
    and.b64 %rd8, %rd7, 3;
    setp.eq.u64 %p3, %rd8, 0;
    @%p3 bra WORDS;
    mov.u64 %rd9, %rd20;
BYTES:
    setp.ge.u64 %p4, %rd9, %rd6;
    @%p4 bra NEXT;
    add.u64 %rd10, %rd5, %rd9;
    ld.global.u8 %r6, [%rd10];
    add.u64 %rd11, %rd4, %rd9;
    st.global.u8 [%rd11], %r6;
    add.u64 %rd9, %rd9, %rd21;
    bra BYTES;
WORDS:
    shl.b64 %rd9, %rd20, 2;
    shl.b64 %rd12, %rd21, 2;
WORD:
    setp.ge.u64 %p5, %rd9, %rd6;
    @%p5 bra NEXT;
    add.u64 %rd10, %rd5, %rd9;
    ld.global.u32 %r6, [%rd10];
    add.u64 %rd11, %rd4, %rd9;
    st.global.u32 [%rd11], %r6;
    add.u64 %rd9, %rd9, %rd12;
    bra WORD;
WIDE:
    shl.b64 %rd9, %rd20, 4;
    shl.b64 %rd12, %rd21, 4;
VECTOR:
    setp.ge.u64 %p6, %rd9, %rd6;
    @%p6 bra NEXT;
    add.u64 %rd10, %rd5, %rd9;
    ld.global.v4.u32 {%r6, %r7, %r8, %r9}, [%rd10];
    add.u64 %rd11, %rd4, %rd9;
    st.global.v4.u32 [%rd11], {%r6, %r7, %r8, %r9};
    add.u64 %rd9, %rd9, %rd12;
    bra VECTOR;
NEXT:
    add.u32 %r2, %r2, %r3;
    bra ENTRY;
DONE:
    ret;
}
)PTX";

}  // namespace gpu
}  // namespace hvdlite
