"""End to end across processes: a prefill-side KV server (sender, lease table, grpc.aio
server, rendezvous TCPStore) in a spawned child, the receiver here, real gloo between."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch

from tandem.kvtransfer.blocks import pack_blocks, unpack_blocks
from tandem.kvtransfer.errors import KVPullFailed, PullFailure
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.testing import RandomKVServer, RandomKVSpec, random_kv_caches

LAYOUT = KVLayout(
    "tiny", num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16
)
NUM_BLOCKS = 32
LEASES = ((3, 17, 8, 30), (0, 1), (12,), (20, 21, 22))
STALLED = 3  # index of the lease whose pulls the server delays
SPEC = RandomKVSpec(LAYOUT, NUM_BLOCKS, LEASES, seed=7, stall_lease=STALLED, stall_s=10.0)


@pytest.fixture(scope="module")
def server() -> Iterator[RandomKVServer]:
    with RandomKVServer(SPEC) as running:
        yield running


@pytest.fixture(scope="module")
def prefill_caches() -> list[torch.Tensor]:
    """The server's KV cache, rebuilt from the same seed."""
    return random_kv_caches(LAYOUT, NUM_BLOCKS, SPEC.seed)


def expected(caches: list[torch.Tensor], lease: int, indices: list[int]) -> torch.Tensor:
    return pack_blocks(caches, [LEASES[lease][i] for i in indices])


@pytest.mark.timeout(60)
def test_pull_moves_exactly_the_named_blocks(
    server: RandomKVServer, prefill_caches: list[torch.Tensor]
) -> None:
    decode_caches = [torch.zeros(LAYOUT.cache_shape(10), dtype=LAYOUT.dtype) for _ in range(3)]

    async def main() -> None:
        receiver = KVReceiver(LAYOUT, "decode-a", "cpu")
        packed = await receiver.pull(server.endpoint, server.lease_ids[0], [2, 0, 3], timeout=20)
        unpack_blocks(decode_caches, [9, 4, 5], packed)
        assert receiver.stats.bytes == 3 * LAYOUT.bytes_per_block
        assert receiver.stats.blocks == 3 and receiver.stats.failed == 0
        await receiver.close()

    asyncio.run(main())
    for layer in range(LAYOUT.num_layers):
        for prefill_block, decode_block in [(8, 9), (3, 4), (30, 5)]:
            sent = prefill_caches[layer][:, prefill_block]
            got = decode_caches[layer][:, decode_block]
            assert torch.equal(got.view(torch.int16), sent.view(torch.int16))  # bit-identical
        for untouched in [0, 1, 2, 3, 6, 7, 8]:
            assert not decode_caches[layer][:, untouched].any()


@pytest.mark.timeout(60)
def test_pulls_of_several_leases_reuse_one_pair(
    server: RandomKVServer, prefill_caches: list[torch.Tensor]
) -> None:
    async def main() -> None:
        receiver = KVReceiver(LAYOUT, "decode-b", "cpu")
        for lease, indices in [(0, [1]), (1, [0, 1]), (2, [0]), (0, [3, 2, 1, 0])]:
            packed = await receiver.pull(server.endpoint, server.lease_ids[lease], indices, 20)
            assert torch.equal(packed, expected(prefill_caches, lease, indices))
        out = torch.empty(LAYOUT.packed_shape(2), dtype=LAYOUT.dtype)
        packed = await receiver.pull(server.endpoint, server.lease_ids[1], [1, 0], 20, out=out)
        assert packed is out and torch.equal(out, expected(prefill_caches, 1, [1, 0]))
        assert receiver.stats.handshakes == 1 and receiver.stats.pulls == 5
        await receiver.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_unknown_lease_fails_typed_and_the_next_pull_works(
    server: RandomKVServer, prefill_caches: list[torch.Tensor]
) -> None:
    async def main() -> None:
        receiver = KVReceiver(LAYOUT, "decode-c", "cpu")
        with pytest.raises(KVPullFailed) as failed:
            await receiver.pull(server.endpoint, "no-such-lease", [0], timeout=20)
        assert failed.value.reason is PullFailure.NOT_FOUND
        assert "no-such-lease" in str(failed.value)
        packed = await receiver.pull(server.endpoint, server.lease_ids[2], [0], timeout=20)
        assert torch.equal(packed, expected(prefill_caches, 2, [0]))
        assert receiver.stats.handshakes == 2  # the failed pull's pair was torn down
        await receiver.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_stuck_sender_times_out_then_a_new_generation_works(
    server: RandomKVServer, prefill_caches: list[torch.Tensor]
) -> None:
    async def main() -> None:
        receiver = KVReceiver(LAYOUT, "decode-d", "cpu")
        await receiver.pull(server.endpoint, server.lease_ids[1], [0], timeout=20)
        started = time.monotonic()
        stuck = receiver.pull(server.endpoint, server.lease_ids[STALLED], [0], timeout=1.0)
        queued = receiver.pull(server.endpoint, server.lease_ids[1], [0], timeout=0.3)
        failures = await asyncio.gather(stuck, queued, return_exceptions=True)
        assert all(isinstance(f, KVPullFailed) for f in failures), failures
        assert [f.reason for f in failures] == [PullFailure.TIMEOUT] * 2
        assert "earlier pulls" in str(failures[1])  # waited behind the stuck one, not forever
        # At its 1 s timeout, not when the stalled sender answers (10 s); the slack is
        # for a loaded machine.
        assert 0.9 < time.monotonic() - started < SPEC.stall_s / 2
        packed = await receiver.pull(server.endpoint, server.lease_ids[1], [1, 0], timeout=20)
        assert torch.equal(packed, expected(prefill_caches, 1, [1, 0]))
        assert receiver.stats.handshakes == 2
        await receiver.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_sender_killed_mid_pull_then_restarted() -> None:
    spec = RandomKVSpec(LAYOUT, NUM_BLOCKS, LEASES, seed=11, stall_lease=STALLED, stall_s=60.0)
    caches = random_kv_caches(LAYOUT, NUM_BLOCKS, spec.seed)

    async def main() -> None:
        receiver = KVReceiver(LAYOUT, "decode-e", "cpu")
        with RandomKVServer(spec) as first:
            await receiver.pull(first.endpoint, first.lease_ids[0], [0], timeout=20)
            pulling = asyncio.ensure_future(
                receiver.pull(first.endpoint, first.lease_ids[STALLED], [0, 1], timeout=20)
            )
            await asyncio.sleep(0.5)  # the receive is posted; the server is in PullBlocks
            started = time.monotonic()
            first.kill()
            with pytest.raises(KVPullFailed) as failed:
                await pulling
        assert failed.value.reason is PullFailure.PEER_LOST
        assert time.monotonic() - started < 5  # not the 20 s timeout

        port = int(first.endpoint.rsplit(":", 1)[1])
        with RandomKVServer(dataclasses.replace(spec, grpc_port=port)) as second:
            assert second.endpoint == first.endpoint
            packed = await receiver.pull(second.endpoint, second.lease_ids[0], [3, 1], 20)
        assert torch.equal(packed, pack_blocks(caches, [LEASES[0][3], LEASES[0][1]]))
        assert receiver.stats.handshakes == 2 and receiver.stats.pulls == 2
        await receiver.close()

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_damaged_bytes_fail_the_pull_and_are_never_used(
    monkeypatch: pytest.MonkeyPatch, prefill_caches: list[torch.Tensor]
) -> None:
    """The sender's second send is damaged after its checksum was taken (fault point
    ``kv.send``): that pull fails as CORRUPT, the others deliver exact bytes."""
    monkeypatch.setenv("TANDEM_FAULTS", "kv.send:corrupt@2")
    spec = dataclasses.replace(SPEC, stall_lease=None)

    async def main(server: RandomKVServer) -> None:
        receiver = KVReceiver(LAYOUT, "decode-corrupt", "cpu")
        first = await receiver.pull(server.endpoint, server.lease_ids[1], [0, 1], timeout=20)
        assert torch.equal(first, expected(prefill_caches, 1, [0, 1]))
        with pytest.raises(KVPullFailed) as failed:
            await receiver.pull(server.endpoint, server.lease_ids[0], [0, 1], timeout=20)
        assert failed.value.reason is PullFailure.CORRUPT
        third = await receiver.pull(server.endpoint, server.lease_ids[2], [0], timeout=20)
        assert torch.equal(third, expected(prefill_caches, 2, [0]))
        assert receiver.stats.failed == 1
        await receiver.close()

    with RandomKVServer(spec) as server:
        asyncio.run(main(server))
