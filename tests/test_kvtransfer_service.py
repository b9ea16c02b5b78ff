"""The KVTransfer gRPC service's status codes and lease calls, with a real grpc.aio server
on a localhost socket (sender and server in this process; the cross-process path is in
test_kvtransfer_e2e.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from tandem.engine.attention.kv_quant import KVCacheDtype
from tandem.kvtransfer.errors import KVPullFailed, PullFailure
from tandem.kvtransfer.layout import KVLayout
from tandem.kvtransfer.leases import EndedLease, LeaseTable
from tandem.kvtransfer.pair import Backend, PairGroup, PairKey, Role, open_store
from tandem.kvtransfer.receiver import KVReceiver
from tandem.kvtransfer.sender import KVSender
from tandem.kvtransfer.service import KVTransferServicer
from tandem.kvtransfer.testing import random_kv_caches
from tandem.protos import PROTOCOL_VERSION, kv_transfer_pb2, kv_transfer_pb2_grpc

LAYOUT = KVLayout(
    "tiny", num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32
)


@dataclass
class Prefill:
    endpoint: str
    leases: LeaseTable
    stub: kv_transfer_pb2_grpc.KVTransferStub
    released: list[list[int]] = field(default_factory=list)

    def on_release(self, lease: EndedLease) -> None:
        self.released.append(list(lease.block_ids))


@asynccontextmanager
async def serving(max_send_s: float = 30.0) -> AsyncIterator[Prefill]:
    sender = KVSender(
        LAYOUT, random_kv_caches(LAYOUT, 8, seed=0), "127.0.0.1", 0, "prefill-0", join_timeout=5.0
    )
    leases = LeaseTable()
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    prefill = Prefill(f"127.0.0.1:{port}", leases, kv_transfer_pb2_grpc.KVTransferStub(channel))
    servicer = KVTransferServicer(sender, leases, prefill.on_release, max_send_s=max_send_s)
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(servicer, server)
    await server.start()
    try:
        yield prefill
    finally:
        await channel.close()
        await server.stop(grace=None)
        sender.close()


def handshake_request(compat: kv_transfer_pb2.KVCompat) -> kv_transfer_pb2.HandshakeRequest:
    return kv_transfer_pb2.HandshakeRequest(
        compat=compat, decode_worker_id="decode-0", device_type="cpu"
    )


MISMATCHES = [
    ("protocol_version", PROTOCOL_VERSION + 1, "protocol version"),
    ("model", "other", "model"),
    ("dtype", "float16", "dtype"),
    ("kv_cache_dtype", "int8", "kv cache dtype"),
    ("block_size", 16, "block size"),
    ("layout", "kv,layer,block,slot,head,dim", "KV layout"),
    ("num_kv_heads", 1, "KV heads"),
    ("head_dim", 4, "head dim"),
    ("num_layers", 3, "layers"),
]


@pytest.mark.timeout(30)
def test_handshake_refuses_each_mismatch_by_name() -> None:
    async def main() -> None:
        async with serving() as prefill:
            for attr, value, named in MISMATCHES:
                compat = LAYOUT.to_compat()
                setattr(compat, attr, value)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await prefill.stub.Handshake(handshake_request(compat), timeout=5)
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert f"{named}: local" in refused.value.details()
                assert repr(value) in refused.value.details()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_incompatible_receiver_gets_a_typed_failure() -> None:
    async def main() -> None:
        async with serving() as prefill:
            lease = prefill.leases.grant("req", [1, 2], ttl=60)
            other = KVLayout("tiny", 2, 4, 2, 8, torch.float16)
            receiver = KVReceiver(other, "decode-0", "cpu")
            with pytest.raises(KVPullFailed) as failed:
                await receiver.pull(prefill.endpoint, lease, [0], timeout=5)
            await receiver.close()
        assert failed.value.reason is PullFailure.INCOMPATIBLE
        assert "dtype: local 'float32', remote 'float16'" in str(failed.value)

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_quantized_receiver_of_a_float_sender_gets_a_typed_failure() -> None:
    """A decode worker with ``--kv-cache-dtype int8`` pulling from a float prefill worker:
    refused by name, so it falls back to prefilling the prompt itself."""

    async def main() -> None:
        async with serving() as prefill:
            lease = prefill.leases.grant("req", [1, 2], ttl=60)
            int8 = dataclasses.replace(LAYOUT, kv_cache_dtype=KVCacheDtype.INT8)
            receiver = KVReceiver(int8, "decode-0", "cpu")
            with pytest.raises(KVPullFailed) as failed:
                await receiver.pull(prefill.endpoint, lease, [0], timeout=5)
            await receiver.close()
        assert failed.value.reason is PullFailure.INCOMPATIBLE
        assert "kv cache dtype: local 'auto', remote 'int8'" in str(failed.value)

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_block_index_beyond_the_lease_is_invalid_argument() -> None:
    async def main() -> None:
        async with serving() as prefill:
            lease = prefill.leases.grant("req", [5, 6], ttl=60)
            receiver = KVReceiver(LAYOUT, "decode-0", "cpu")
            with pytest.raises(KVPullFailed) as failed:
                await receiver.pull(prefill.endpoint, lease, [0, 2], timeout=5)
            await receiver.close()
            assert failed.value.reason is PullFailure.BAD_REQUEST
            assert "block index 2 out of range" in str(failed.value)
            assert prefill.leases.release(lease).ended.block_ids == (5, 6)  # unpinned after failure

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_unknown_pair_and_stale_generation_are_not_found() -> None:
    async def main() -> None:
        async with serving() as prefill:
            lease = prefill.leases.grant("req", [1], ttl=60)
            first = await prefill.stub.Handshake(handshake_request(LAYOUT.to_compat()))
            second = await prefill.stub.Handshake(handshake_request(LAYOUT.to_compat()))
            assert second.generation == first.generation + 1 and second.pair_id == first.pair_id
            for pair_id, generation in [(first.pair_id, first.generation), ("nope", 1)]:
                request = kv_transfer_pb2.PullBlocksRequest(
                    lease_id=lease,
                    pair_id=pair_id,
                    generation=generation,
                    block_indices=[0],
                    tag=1,
                )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await prefill.stub.PullBlocks(request, timeout=5)
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_send_past_its_deadline_is_deadline_exceeded_and_frees_late() -> None:
    """A receiver that joined but never posts its recv: the send times out at the server's
    bound; a release that arrived meanwhile hands the blocks back only after the send."""

    async def main() -> None:
        async with serving(max_send_s=1.0) as prefill:
            lease = prefill.leases.grant("req", [3, 4], ttl=60)
            offer = await prefill.stub.Handshake(handshake_request(LAYOUT.to_compat()))
            group = await asyncio.to_thread(join_as_receiver, offer)
            request = kv_transfer_pb2.PullBlocksRequest(
                lease_id=lease,
                pair_id=offer.pair_id,
                generation=offer.generation,
                block_indices=[0, 1],
                tag=1,
            )
            pulling = asyncio.ensure_future(prefill.stub.PullBlocks(request, timeout=20))
            await asyncio.sleep(0.3)
            released = await prefill.stub.ReleaseLease(kv_transfer_pb2.LeaseRequest(lease_id=lease))
            assert released.found and prefill.released == []  # still being read
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as timed_out:
                await pulling
            assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "timed out" in timed_out.value.details()
            assert time.monotonic() - started < 5
            await asyncio.sleep(0.1)  # on_release is scheduled onto the loop
            assert prefill.released == [[3, 4]] and len(prefill.leases) == 0
            group.close()

    asyncio.run(main())


def join_as_receiver(offer: kv_transfer_pb2.HandshakeResponse) -> PairGroup:
    store = open_store(offer.store_host, offer.store_port, 5)
    key = PairKey(offer.pair_id, offer.generation)
    cpu = torch.device("cpu")
    return PairGroup.connect(store, key, Role.RECEIVER, Backend.GLOO, cpu, "127.0.0.1", 5)


@pytest.mark.timeout(30)
def test_renew_and_release_over_the_wire() -> None:
    async def main() -> None:
        async with serving() as prefill:
            lease = prefill.leases.grant("req", [7, 1], ttl=30)
            receiver = KVReceiver(LAYOUT, "decode-0", "cpu")
            ttl = await receiver.renew(prefill.endpoint, lease)
            assert ttl is not None and 29 < ttl <= 30
            assert await receiver.release(prefill.endpoint, lease)
            assert prefill.released == [[7, 1]]
            assert not await receiver.release(prefill.endpoint, lease)
            assert await receiver.renew(prefill.endpoint, lease) is None
            assert prefill.released == [[7, 1]]
            await receiver.close()

    asyncio.run(main())
