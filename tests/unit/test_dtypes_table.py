"""The dtype table: canonical names, numpy dtypes and native codes agree both ways."""
import ml_dtypes
import numpy as np
import pytest

from hvdlite import dtypes
from hvdlite.errors import InvalidArgumentError

EXPECTED = {
    "uint8": np.uint8, "int8": np.int8, "uint16": np.uint16, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
    "float64": np.float64, "bool": np.bool_,
}
UNSUPPORTED = [np.complex64, np.complex128, object, "U3", "S3",
               np.uint32, np.uint64, ">f4", [("a", np.int32)]]


def test_supported_names_are_the_spec():
    assert set(dtypes.SUPPORTED) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_numpy_round_trip(name):
    dt = dtypes.numpy_dtype(name)
    assert dt == np.dtype(EXPECTED[name])
    assert dtypes.name_of_numpy(dt) == name


@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=str)
def test_unsupported_numpy_dtypes(dtype):
    assert dtypes.name_of_numpy(dtype) is None
    with pytest.raises(InvalidArgumentError) as info:
        dtypes.code_of_numpy(np.dtype(dtype), tensor_name="grad.w")
    message = str(info.value)
    assert "grad.w" in message
    assert "float32" in message and "bfloat16" in message  # lists the supported ones


def test_unknown_name_is_refused():
    with pytest.raises(InvalidArgumentError, match="complex64"):
        dtypes.numpy_dtype("complex64")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_native_round_trip(native, name):
    code = dtypes.native_code(name)
    assert code == getattr(native.lib, "HVDLITE_" + name.upper())
    assert dtypes.name_of_code(code) == name
    assert dtypes.numpy_dtype_of_code(code) == np.dtype(EXPECTED[name])
    assert dtypes.code_of_numpy(EXPECTED[name]) == code


def test_native_codes_are_distinct(native):
    codes = [dtypes.native_code(name) for name in dtypes.SUPPORTED]
    assert len(set(codes)) == len(codes)


def test_unknown_native_code(native):
    with pytest.raises(InvalidArgumentError, match="12345"):
        dtypes.name_of_code(12345)
    with pytest.raises(InvalidArgumentError, match="tensor 'x'.*uint32"):
        dtypes.native_code("uint32", tensor_name="x")
