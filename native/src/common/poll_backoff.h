// How the background thread waits on nonblocking MPI without spinning a core.
//
// MPI offers no way to sleep until a request completes (MPICH's blocking calls poll),
// so a wait polls and sleeps between polls. A sleep cannot be cut short by the
// completion it waits for: whatever is left of it when the peer's message arrives is
// added to the wait, and collectives of several steps (a coordination round, a ring)
// add it once per step on every rank that sleeps. So the sleeps start short and grow
// with the time already waited (an eighth of it): a wait that ends soon costs a few
// tens of microseconds more at most, one that goes on (a peer still computing) costs
// at most an eighth more and only a logarithmic number of wake-ups, up to `max_sleep`
// between polls. The first few microseconds poll without sleeping: a peer in step
// with us is often there by then, and a nanosleep costs more than that.
//
// While data is in flight the cap is lower (kDataMaxSleep): MPI moves a transfer on
// only in the polls (each rendezvous handshake, the next fragments into the socket),
// so every poll interval can leave the link idle. On the namespace cluster at 1 Gbit/s
// a 1 MiB collective took ~0.5 ms longer with 200 us than with 50 us between polls.
// But 50 us all along costs a long transfer 0.1-0.26 of a core (20,000 polls a
// second; a 16 MiB flat allreduce at 100 Mbit/s), so that cap rises with the wait too,
// to 1/kDataCapDivisor of it, up to kDataLongMaxSleep: unchanged for the first 10 ms
// (a 1 MiB collective at 1 Gbit/s is ~8 ms), 500 us from 100 ms on, where a poll
// interval is a small part of the transfer (measured on the namespace cluster, one
// rank per host: rising to 1 ms cost 16-64 MiB flat collectives 0.5-1.3% at 1 Gbit/s
// and left a waiting rank 0.01-0.10 of a core at 100 Mbit/s; to 250 us, no loss and
// 0.04-0.17 of a core; to 500 us, no loss and 0.03-0.12).
//
// The cycle's thread only (each wait has its own).
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

namespace hvdlite {

class PollBackoff {
 public:
  using Clock = std::chrono::steady_clock;
  // spin: how long the wait polls without sleeping (kSpin; longer where a caller
  // blocks on the result and a core is there for it: MpiBackend::set_caller_waiting).
  explicit PollBackoff(std::chrono::microseconds max_sleep = kWaitMaxSleep,
                       std::chrono::microseconds spin = kSpin)
      : max_sleep_(max_sleep), spin_(spin), since_(Clock::now()) {}
  // Something moved (a step of a collective completed): the wait starts over, short.
  void Progressed() { since_ = Clock::now(); }
  // After a poll that found nothing done: polls again at once during the first
  // spin of the wait, else sleeps 1/8 of the wait so far, within [kMinSleep, the cap]:
  // max_sleep, or 1/kDataCapDivisor of the wait when that is longer (up to
  // kDataLongMaxSleep; a longer max_sleep is never lowered).
  void Pause() {
    const auto waited = Clock::now() - since_;
    if (waited < spin_) return;
    const auto sleep = std::chrono::duration_cast<std::chrono::microseconds>(waited / 8);
    const auto cap = std::max(
        max_sleep_, std::min(kDataLongMaxSleep, std::chrono::duration_cast<std::chrono::microseconds>(
                                                    waited / kDataCapDivisor)));
    std::this_thread::sleep_for(std::min(cap, std::max(kMinSleep, sleep)));
  }

  static constexpr std::chrono::microseconds kWaitMaxSleep{1000};
  static constexpr std::chrono::microseconds kDataMaxSleep{50};
  static constexpr int kDataCapDivisor = 200;
  static constexpr std::chrono::microseconds kDataLongMaxSleep{500};
  static constexpr std::chrono::microseconds kSpin{10};
  // A blocking caller's wait across hosts: a peer's answer over TCP is due within
  // ~100 us, and each sleep before it costs a wake-up of 20-60 us.
  static constexpr std::chrono::microseconds kCallerSpin{100};
  static constexpr std::chrono::microseconds kMinSleep{10};

 private:
  const std::chrono::microseconds max_sleep_;
  const std::chrono::microseconds spin_;
  Clock::time_point since_;
};

}  // namespace hvdlite
