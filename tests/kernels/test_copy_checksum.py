"""The one-pass copy and checksum kernel (kernels/ops/checksum/triton.py) against its reference
(naive.py): the copy equals the source and the three sums equal the reference's exactly, for
buffers of full rows, a tail, one word, and words whose products overflow int64 sums; one changed
or two swapped words change the sums. Under Triton's interpreter on CPU, on the GPU there."""

import pytest
import torch
from hybridcache.kernels.ops.checksum import naive
from kernel_testing import checksum_sums, copy_checksum, device

ROW = naive.ROW


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device())


@pytest.mark.parametrize("n_bytes", [4, 4 * 37, 4 * ROW, 4 * (3 * ROW + 5), 4 * (2 * ROW) + 256])
def test_copy_and_sums_equal_the_reference(n_bytes):
    src = _random_bytes(n_bytes, n_bytes)
    dst = torch.zeros_like(src)
    got = copy_checksum(src, dst)
    assert torch.equal(dst, src)
    want = naive.checksum_sums(src)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    assert checksum_sums(src).tolist() == want.tolist()


def test_sums_wrap_as_the_reference_does():
    # every word -2^31 over 2,000 rows and a tail: the column-weighted int64 sum passes -2^63 and wraps
    w = torch.full((ROW * 2000 + 11,), -(2**31), dtype=torch.int32)
    src = w.view(torch.uint8).to(device())
    exact_s3 = -(2**31) * (2000 * ROW * (ROW + 1) // 2 + 11 * 12 // 2)
    assert exact_s3 < -(2**63)
    got = checksum_sums(src).tolist()
    assert got[2] == (exact_s3 + 2**63) % 2**64 - 2**63
    assert got == naive.checksum_sums(src).tolist()


def test_a_changed_or_swapped_word_changes_the_sums():
    src = _random_bytes(4 * (ROW + 9), 3)
    base = checksum_sums(src).tolist()
    changed = src.clone()
    changed[4 * 100] ^= 1
    assert checksum_sums(changed).tolist() != base
    words = src.clone().view(torch.int32)
    words[[7, ROW + 2]] = words[[ROW + 2, 7]]
    assert checksum_sums(words.view(torch.uint8)).tolist() != base


def test_other_buffers_take_the_reference():
    src = _random_bytes(4 * 10 + 3, 5)  # no multiple of 4 bytes
    dst = torch.empty_like(src)
    assert copy_checksum(src, dst).tolist() == naive.checksum_sums(src).tolist() and torch.equal(dst, src)
    with pytest.raises(ValueError, match="uint8"):
        copy_checksum(src.float(), dst.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_arena_slot_sized_buffer_on_the_gpu():
    """A layer slot of a 32-entry build (about 128 MiB) and an odd tail, on the GPU."""
    src = torch.randint(0, 256, (128 * 2**20 + 4 * 1001,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    got = copy_checksum(src, dst)
    assert torch.equal(dst, src) and got.tolist() == naive.checksum_sums(src).tolist()


def test_warm_compiles_only_for_cuda_devices():
    from hybridcache.services.transport import checksum

    assert checksum.warm(torch.device("cpu")) is False
    if torch.cuda.is_available():
        assert checksum.warm(torch.device("cuda", 0)) is True
