"""Transfer building blocks in-process: frames, proofs, backoff, striping plans."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import socket
import time
from collections.abc import Awaitable, Callable

import pytest

from lmcache_p2p.errors import ProtocolError
from lmcache_p2p.ids import PeerAddress
from lmcache_p2p.keys import ChunkKey
from lmcache_p2p.testing.striping import merge, plan_stripes
from lmcache_p2p.transfer import wire
from lmcache_p2p.transfer.base import MissReason, PullResult
from lmcache_p2p.transfer.health import PeerHealth
from lmcache_p2p.transfer.netio import connect_tcp, staggered_connect
from lmcache_p2p.transfer.tls import NODE_URI, cert_nodes, names_node

A, B = PeerAddress("127.0.0.1", 1, "a"), PeerAddress("127.0.0.1", 2, "b")


def test_frame_round_trip_and_limits() -> None:
    frame = wire.encode({"t": "get", "id": 3, "keys": [b"k" * 16]}, 7)
    header_len, payload_len = wire.decode_prefix(frame, 4096)
    assert payload_len == 7
    msg = wire.decode(frame[wire.PREFIX_SIZE : wire.PREFIX_SIZE + header_len])
    assert wire.key_list(msg) == [b"k" * 16] and wire.field(msg, "id", int) == 3
    with pytest.raises(ProtocolError):
        wire.decode_prefix(wire.PREFIX.pack(5000, 0), 4096)
    with pytest.raises(ProtocolError):
        wire.decode_prefix(wire.PREFIX.pack(0, 0), 4096)
    with pytest.raises(ProtocolError):
        wire.decode(b"\xc1garbage")
    with pytest.raises(ProtocolError):
        wire.field({"t": "x", "id": True}, "id", int)
    with pytest.raises(ProtocolError):
        wire.key_list({"t": "get", "keys": [b"short"]})


def test_proofs_bind_role_secret_nonces_channel_and_both_node_ids() -> None:
    t = wire.Transcript(b"f" * 16, b"c" * 32, b"s" * 32, b"", "owner-a", "requester-b")
    p = wire.proof(b"secret", b"S", t)
    assert wire.proof_ok(p, wire.proof(b"secret", b"S", t))
    assert not wire.proof_ok(p, wire.proof(b"secret", b"C", t))
    assert not wire.proof_ok(p, wire.proof(b"other", b"S", t))
    for change in ({"nonce_s": b"t" * 32}, {"binding": b"b" * 32}, {"owner": "owner-b"}, {"requester": ""},
                   {"owner": "owner-", "requester": "arequester-b"}):  # length-prefixed: no shifting bytes over
        assert not wire.proof_ok(p, wire.proof(b"secret", b"S", dataclasses.replace(t, **change))), change
    assert wire.session_key(b"secret", t) != wire.session_key(b"secret", dataclasses.replace(t, owner="x"))
    assert not wire.proof_ok(p, "not bytes")
    with pytest.raises(ProtocolError):
        wire.proof(b"secret", b"S", dataclasses.replace(t, owner="x" * 256))


def test_peer_health_backs_off_exponentially() -> None:
    now = [0.0]
    health = PeerHealth(1.0, 4.0, clock=lambda: now[0], rng=lambda: 1.0)  # the top of each jitter range
    assert health.available(A) and health.backed_off() == 0
    health.record_failure(A, "boom")
    assert not health.available(A) and health.available(B) and health.backed_off() == 1
    now[0] = 1.0
    assert health.available(A) and health.backed_off() == 0
    health.record_failure(A, "boom")
    health.record_failure(A, "boom")
    health.record_failure(B, "boom")
    now[0] = 4.9
    assert not health.available(A) and health.backed_off() == 1  # B's first backoff (1 s) has passed
    now[0] = 5.0
    assert health.available(A) and health.backed_off() == 0
    health.record_success(A)
    assert health.failures(A) == 0


def test_the_peers_not_asked_now_are_named_for_the_scheduler() -> None:
    """``unavailable``: what the worker tells its scheduler after each step (``WorkerState``): the node ids of
    peers backed off, and of peers held (an answer overdue past its grace, no byte since), until either ends."""
    now, heard = [0.0], [0.0]
    health = PeerHealth(1.0, 4.0, clock=lambda: now[0], rng=lambda: 1.0)
    assert health.unavailable() == frozenset()
    health.record_failure(A, "boom")
    token = health.hold(B, grace_s=0.1, progress_at=lambda: heard[0])
    assert health.unavailable() == {A.node_id}  # B's hold starts after its grace
    now[0] = 0.2
    assert health.unavailable() == {A.node_id, B.node_id}
    heard[0] = 0.15  # bytes from B: slow, not hung
    assert health.unavailable() == {A.node_id}
    heard[0] = 0.0
    now[0] = 1.0
    assert health.unavailable() == {B.node_id}  # A's backoff is over
    health.release(B, token)
    assert health.unavailable() == frozenset()


def test_peer_health_backoff_is_jittered_between_half_and_all_of_it() -> None:
    """Requesters that saw a peer fail together come back spread over [d/2, d], not all at once."""
    now, draw = [0.0], [0.0]
    health = PeerHealth(1.0, 4.0, clock=lambda: now[0], rng=lambda: draw[0])
    for failures, nominal in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 4.0)):
        health.record_failure(A, "boom")
        assert health.failures(A) == failures
        now[0] += nominal / 2 - 1e-9
        assert not health.available(A)  # never less than half the nominal wait
        now[0] += 1e-9
        assert health.available(A)
    for _ in range(2000):  # past 2.0**1024 without overflowing; still max_s at most
        health.record_failure(B, "boom")
    draw[0] = 0.999
    health.record_failure(B, "boom")
    assert not health.available(B)
    now[0] += 4.0
    assert health.available(B)
    t = [0.0]
    spread = PeerHealth(2.0, clock=lambda: t[0], rng=random.Random(7).random)
    peers = [PeerAddress("127.0.0.1", 100 + i, f"p{i}") for i in range(20)]
    for peer in peers:  # all fail at once
        spread.record_failure(peer, "boom")
    t[0] = 1.5
    assert 0 < spread.backed_off() < len(peers)  # and come back spread over [1 s, 2 s]
    t[0] = 2.0
    assert spread.backed_off() == 0


def test_plan_stripes_balances_owners() -> None:
    keys = [ChunkKey(bytes([i]) * 16) for i in range(6)]
    plan = plan_stripes({k: [A, B] for k in keys})
    assert sorted(len(v) for v in plan.values()) == [3, 3]
    assert plan_stripes({keys[0]: []}) == {}
    ra, rb = PullResult(A), PullResult(B)
    ra.missed[keys[0]] = MissReason.ABSENT
    rb.missed[keys[1]] = MissReason.TIMEOUT
    loaded, missed = merge({A: ra, B: rb})
    assert loaded == set() and missed == {keys[0], keys[1]}
    ra.miss_rest(keys[:3], MissReason.PEER_ERROR)
    assert ra.missed[keys[0]] == MissReason.ABSENT and ra.missed[keys[2]] == MissReason.PEER_ERROR


def test_a_certificate_name_covers_its_node_and_that_nodes_tp_ranks() -> None:
    cert = {"subjectAltName": (("DNS", "x"), ("URI", NODE_URI + "eng"), ("URI", "spiffe://other"))}
    assert cert_nodes(cert) == {"eng"} and cert_nodes(None) == frozenset() and cert_nodes({}) == frozenset()
    assert names_node({"eng"}, "eng") and names_node({"eng"}, "eng-r0") and names_node({"eng"}, "eng-r12")
    for other in ("en", "engx", "eng-r", "eng-rx", "eng-r1-r2", "x-eng", "other"):
        assert not names_node({"eng"}, other), other


def test_staggered_connect_takes_the_first_attempt_that_answers_and_closes_the_rest() -> None:
    """A first attempt whose SYN was lost hangs; a fresh one a stagger later wins; the rest are cancelled."""
    started: list[int] = []
    closed: list[int] = []

    def attempts(outcomes: list[float | BaseException | None]) -> Callable[[], Awaitable[int]]:
        async def attempt() -> int:
            n = len(started)
            started.append(n)
            outcome = outcomes[n] if n < len(outcomes) else None
            if isinstance(outcome, BaseException):
                raise outcome
            await asyncio.sleep(3600 if outcome is None else outcome)  # None: a SYN that never arrives
            return n

        return attempt

    async def main() -> None:
        # Lost, lost, then a path that works: the third attempt (started at ~2 x every_s) wins.
        t0 = time.monotonic()
        assert await staggered_connect(attempts([None, None, 0.0]), closed.append, 5.0, every_s=0.05) == 2
        assert time.monotonic() - t0 < 1.0 and started == [0, 1, 2] and closed == []
        # An answer (refused) ends it at once; the hung attempt is cancelled, nothing leaks.
        started.clear()
        with pytest.raises(ConnectionRefusedError):
            await staggered_connect(attempts([None, ConnectionRefusedError()]), closed.append, 5.0, every_s=0.05)
        # Nothing answers: TimeoutError at the deadline, at most ``most`` attempts in flight.
        started.clear()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await staggered_connect(attempts([]), closed.append, 0.5, every_s=0.02, most=4)
        assert 0.45 <= time.monotonic() - t0 < 2.0 and len(started) == 4
        # A slow first attempt loses to a fresh one and is cancelled, not left connecting.
        started.clear()
        assert await staggered_connect(attempts([0.5, 0.0]), closed.append, 5.0, every_s=0.05) == 1
        await asyncio.sleep(0.6)
        assert closed == []

    asyncio.run(main())


def test_connect_tcp_refused_is_an_answer_not_a_wait() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connections are refused

        async def main() -> None:
            t0 = time.monotonic()
            with pytest.raises(ConnectionRefusedError):
                await connect_tcp("127.0.0.1", port, 5.0)
            assert time.monotonic() - t0 < 2.0

        asyncio.run(main())


def test_connect_tcp_tries_the_next_address_when_one_refuses() -> None:
    """A name that resolves to an address nobody listens on first (``::1`` of a dual-stack ``localhost``
    when the owner listens on IPv4): refused there, connected at the next."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        async def main() -> None:
            loop = asyncio.get_running_loop()
            stream = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "")

            async def resolve(*_: object, **__: object) -> list[tuple[object, ...]]:
                return [(*stream, ("127.0.0.2", port)), (*stream, ("127.0.0.1", port))]  # 127.0.0.2: refused

            loop.getaddrinfo = resolve  # this loop only: the test resolves the name itself
            sock = await connect_tcp("dual-stack.example", port, 5.0)
            try:
                assert sock.getpeername() == ("127.0.0.1", port)
            finally:
                sock.close()

        asyncio.run(main())


def test_an_owner_is_taken_for_silent_after_its_round_trip_and_variation_never_sooner_than_the_floor() -> None:
    """``Connection.ack_timeout``: none until the owner agreed to acknowledge and a round trip was measured;
    then twice the smoothed round trip plus four variations (RFC 6298's gains), at least ``ACK_FLOOR_S``;
    one slow sample widens it at once, steady fast ones narrow it again."""
    from lmcache_p2p.transfer.connection import ACK_FLOOR_S, Connection

    conn = Connection("peer", 1 << 20)
    assert conn.ack_timeout() is None
    conn.observe_rtt(0.016)
    assert conn.ack_timeout() is None  # the owner did not say it acknowledges (an older owner)
    conn.acks = True
    assert conn.ack_timeout() == pytest.approx(2 * 0.016 + 4 * 0.008)
    for _ in range(50):
        conn.observe_rtt(0.0002)
    assert conn.ack_timeout() == ACK_FLOOR_S  # a fast loopback: the floor
    conn.observe_rtt(0.080)  # the owner's loop was busy once
    widened = conn.ack_timeout()
    assert widened is not None and widened > 0.080
    for _ in range(50):
        conn.observe_rtt(0.0002)
    narrowed = conn.ack_timeout()
    assert narrowed is not None and narrowed < widened
    # given up on for its silence, then answering (scheduled late on a starved host): each give-up doubles
    # the silence allowed, up to MAX_SILENCE_BACKOFF times (an ack in time resets it: test_transfer_peers)
    from lmcache_p2p.transfer.connection import MAX_SILENCE_BACKOFF

    conn.silenced()
    assert conn.ack_timeout() == pytest.approx(2 * narrowed)
    for _ in range(10):
        conn.silenced()
    assert conn.ack_timeout() == pytest.approx(MAX_SILENCE_BACKOFF * narrowed)


def test_a_pause_mid_answer_widens_the_next_pause_allowed_not_the_wait_for_an_ack() -> None:
    """``client.stalled_for``: an answer that stopped mid-way is given up on after ``STALL_SILENCES`` times the
    silence allowed, and each such give-up doubles the pause the next answer may take (its owner, paused by a
    starved host, is given more room), while the wait for the owner's next ack stays its round trips' (it
    acknowledged in time: a healthy pull that paused once made the next stopped owner's silence cost 2x).
    An answer that arrives whole resets the pause allowed."""
    from lmcache_p2p.transfer.client import STALL_SILENCES, stalled_for
    from lmcache_p2p.transfer.connection import ACK_FLOOR_S, Connection

    async def main() -> None:
        loop = asyncio.get_running_loop()
        conn = Connection("peer", 1 << 20)
        conn.acks = True
        conn.observe_rtt(0.0002)
        ack_wait = conn.ack_timeout()
        assert ack_wait == ACK_FLOOR_S
        waits = []
        for _ in range(2):
            conn.last_progress = time.monotonic()
            answer = loop.create_future()
            waits.append(await stalled_for(conn, [answer], time.monotonic() + 5.0, silence_s=0.001,
                                           since=conn.last_progress))
        assert waits[0] >= STALL_SILENCES * ACK_FLOOR_S and waits[1] >= 2 * STALL_SILENCES * ACK_FLOOR_S
        assert conn.stall_backoff == 4.0 and conn.ack_timeout() == ack_wait
        conn.last_progress = time.monotonic()
        whole = loop.create_future()
        loop.call_later(0.001, whole.set_result, None)
        assert await stalled_for(conn, [whole], time.monotonic() + 5.0, silence_s=0.001,
                                 since=conn.last_progress) == 0.0
        assert conn.stall_backoff == 1.0

    asyncio.run(main())


def test_a_pause_is_counted_from_the_request_not_from_an_older_answers_last_byte() -> None:
    """``client.stalled_for`` counts silence from when the requests were sent at the earliest: a connection
    whose last byte came 1 s ago (another pull's answer) is not taken for stalled the moment a new request
    goes out (it was, and a stopped owner's load counted ``stalled`` after 0.3 ms: its ack wait had been cut
    short by the deadline)."""
    from lmcache_p2p.transfer.client import STALL_SILENCES, stalled_for
    from lmcache_p2p.transfer.connection import ACK_FLOOR_S, Connection

    async def main() -> None:
        conn = Connection("peer", 1 << 20)
        conn.acks = True
        conn.observe_rtt(0.0002)
        conn.last_progress = time.monotonic() - 1.0
        sent = time.monotonic()
        waited = await stalled_for(conn, [asyncio.get_running_loop().create_future()], sent + 5.0, silence_s=0.001,
                                   since=sent)
        assert STALL_SILENCES * ACK_FLOOR_S <= waited < 0.5 and time.monotonic() - sent >= STALL_SILENCES * ACK_FLOOR_S

    asyncio.run(main())
