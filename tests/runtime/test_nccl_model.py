"""The NCCL model's rules, each reproducing its hazard on a case worked by hand (issue 39).

Every case is small enough to follow on paper: which op waits for which, and why the ranks stop
(or finish) under each rule. The model is the certificate of the runtime
(:mod:`megatron_zb.runtime.comm_certify`), so each rule has a case that fails without it and a
control that completes.
"""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_zb.runtime.nccl_model import ALL_RULES, Call, Kind, Rules, replay

STREAMS = Rules()


def send(comm, members, peer, key, **kw) -> Call:
    return Call(Kind.SEND, comm=comm, members=members, peer=peer, key=key, **kw)


def recv(comm, members, peer, key, **kw) -> Call:
    return Call(Kind.RECV, comm=comm, members=members, peer=peer, key=key, **kw)


def coll(comm, members, key, **kw) -> Call:
    return Call(Kind.COLL, comm=comm, members=members, key=key, **kw)


def wait(key) -> Call:
    return Call(Kind.WAIT, key=key)


def host_wait(key) -> Call:
    return Call(Kind.HOST_WAIT, key=key)


def create(comm, members) -> Call:
    return Call(Kind.CREATE, comm=comm, members=members)


PAIR = (0, 1)


def test_two_ranks_sending_first_on_one_pair_communicator_wait_for_each_other():
    """Both ranks send first on their one communicator (one stream): each send waits for a receive
    queued behind the other's send. Unbuffered sends (real activation sizes) hang; buffered ones
    (gloo, small tensors) complete; one communicator per direction completes too."""
    one = {0: [send("c", PAIR, 1, "a"), recv("c", PAIR, 1, "b"), wait("b")],
           1: [send("c", PAIR, 0, "b"), recv("c", PAIR, 0, "a"), wait("a")]}
    res = replay(one, STREAMS)
    assert not res.completed
    assert res.blocked[0].endswith("compute waits for recv b on c peer 1 (behind send a on c peer 1 (not started on "
                                   "rank(s) [1]) on its communicator)")
    assert replay(one, Rules(eager_sends=True)).completed
    per_direction = {0: [send("c01", PAIR, 1, "a"), recv("c10", PAIR, 1, "b"), wait("b")],
                     1: [send("c10", PAIR, 0, "b"), recv("c01", PAIR, 0, "a"), wait("a")]}
    assert replay(per_direction, STREAMS).completed


def test_creation_order_inverted_across_two_groups_hangs_under_lazy_creation():
    """Rank 0 first uses communicator A, then B; rank 1 first uses B, then A. Created at their first
    op, each creation is a host rendezvous: rank 0 waits in A's for rank 1, rank 1 in B's for rank 0.
    Created up front in one order (what the runtime's warm-up does) the same ops complete."""
    ops = {0: [send("A", PAIR, 1, "x"), recv("B", PAIR, 1, "y"), wait("y")],
           1: [send("B", PAIR, 0, "y"), recv("A", PAIR, 0, "x"), wait("x")]}
    assert replay(ops, STREAMS).completed
    res = replay(ops, Rules(lazy_init=True))
    assert not res.completed
    assert "host in the creation of A" in res.blocked[0] and "waits for rank(s) [1]" in res.blocked[0]
    assert "host in the creation of B" in res.blocked[1] and "waits for rank(s) [0]" in res.blocked[1]
    warmed = {r: [create("A", PAIR), create("B", PAIR)] + calls for r, calls in ops.items()}
    assert replay(warmed, ALL_RULES).completed


def test_two_same_stream_sends_ahead_of_a_needed_receive_hang_on_one_hardware_queue():
    """Each rank sends twice on its direction's communicator, then receives. With a stream per
    communicator the second send waits on its own stream only; on one hardware queue it cannot start
    (its predecessor waits for the peer's receive) and blocks the receive queued behind it."""
    ops = {0: [send("c01", PAIR, 1, "a"), send("c01", PAIR, 1, "b"), recv("c10", PAIR, 1, "c"),
               recv("c10", PAIR, 1, "d"), wait("c"), wait("d")],
           1: [send("c10", PAIR, 0, "c"), send("c10", PAIR, 0, "d"), recv("c01", PAIR, 0, "a"),
               recv("c01", PAIR, 0, "b"), wait("a"), wait("b")]}
    assert replay(ops, STREAMS).completed
    res = replay(ops, Rules(one_queue=True))
    assert not res.completed
    assert "queue head send b on c01 peer 1 waits for its predecessor send a on c01 peer 1" in res.blocked[0]
    assert res.held_back == {"c01", "c10"}
    # the second send of each direction on a communicator of its own: nothing waits behind a predecessor
    slotted = {0: [send("c01", PAIR, 1, "a"), send("c01'", PAIR, 1, "b"), recv("c10", PAIR, 1, "c"),
                   recv("c10'", PAIR, 1, "d"), wait("c"), wait("d")],
               1: [send("c10", PAIR, 0, "c"), send("c10'", PAIR, 0, "d"), recv("c01", PAIR, 0, "a"),
                   recv("c01'", PAIR, 0, "b"), wait("a"), wait("b")]}
    assert replay(slotted, Rules(one_queue=True)).completed


def test_nccl_calls_from_two_host_threads_are_refused():
    """NCCL does not order calls made from two host threads, so their order could differ between
    ranks: the model refuses to replay them (the runtime's vocabulary barriers used to run on a thread)."""
    ops = {0: [coll("g", PAIR, "x"), coll("h", PAIR, "y", thread="barrier")],
           1: [coll("g", PAIR, "x"), coll("h", PAIR, "y")]}
    res = replay(ops, STREAMS)
    assert not res.completed and res.refused == "rank 0 issues NCCL calls from host threads barrier, main"
    compute_on_a_thread = {0: [coll("g", PAIR, "x"), Call(Kind.RUN, label="loss", thread="barrier")],
                           1: [coll("g", PAIR, "x")]}
    assert replay(compute_on_a_thread, STREAMS).completed


def test_a_host_wait_stops_the_host_where_a_stream_wait_does_not():
    """Rank 0 waits for x before creating B; rank 1 sends x only after creating B. A stream wait lets
    rank 0's host go on to B's creation; a host wait (gloo, a wait with a timeout) keeps it from there."""
    def ranks(w):
        return {0: [recv("A", PAIR, 1, "x"), w("x"), create("B", PAIR)],
                1: [create("B", PAIR), send("A", PAIR, 0, "x")]}
    assert replay(ranks(wait), ALL_RULES, created=["A"]).completed
    res = replay(ranks(host_wait), ALL_RULES, created=["A"])
    assert not res.completed and "host waits for recv x on A peer 1" in res.blocked[0]


def test_a_host_sync_waits_for_the_compute_stream():
    """``.item()`` on a CUDA tensor (a SYNC) waits for everything the compute stream was given, here a
    stream wait for x, which rank 1 sends only after a creation rank 0 reaches after its sync."""
    ops = {0: [recv("A", PAIR, 1, "x"), wait("x"), Call(Kind.SYNC), create("B", PAIR)],
           1: [create("B", PAIR), send("A", PAIR, 0, "x")]}
    res = replay(ops, ALL_RULES, created=["A"])
    assert not res.completed and "for the compute stream" in res.blocked[0]
    without = {0: [recv("A", PAIR, 1, "x"), wait("x"), create("B", PAIR)], 1: ops[1]}
    assert replay(without, ALL_RULES, created=["A"]).completed


def test_a_broadcast_ties_its_receivers_together_where_sends_do_not():
    """Rank 0 hands b to ranks 1 and 2. Rank 2 takes part only after rank 1 sent it y, which rank 1 does
    only once it has b. As a broadcast (a collective: every member must join) rank 1 waits for rank 2;
    as sends from rank 0 to each it does not -- why the vocabulary passes send X, the loss gradient and
    the embedding's gradient point to point."""
    three = (0, 1, 2)
    bcast = {0: [coll("b", three, "b")],
             1: [coll("b", three, "b"), wait("b"), send("y", (1, 2), 2, "y")],
             2: [recv("y", (1, 2), 1, "y"), wait("y"), coll("b", three, "b"), wait("b")]}
    res = replay(bcast, STREAMS)
    assert not res.completed and "(not started on rank(s) [2])" in res.blocked[1]
    sends = {0: [(send("b01", (0, 1), 1, "b"), send("b02", (0, 2), 2, "b"))],
             1: [recv("b01", (0, 1), 0, "b"), wait("b"), send("y", (1, 2), 2, "y")],
             2: [recv("y", (1, 2), 1, "y"), wait("y"), recv("b02", (0, 2), 0, "b"), wait("b")]}
    assert replay(sends, ALL_RULES).completed


def test_a_group_starts_and_completes_as_one():
    """megatron-core's batch_isend_irecv: [send F1, recv B0] as one group on each side completes on one
    communicator, where the same ops one by one hang (unbuffered)."""
    single = {0: [send("c", PAIR, 1, "f1"), recv("c", PAIR, 1, "b0"), wait("b0")],
              1: [send("c", PAIR, 0, "b0"), recv("c", PAIR, 0, "f1"), wait("f1")]}
    assert not replay(single, STREAMS).completed
    grouped = {0: [(send("c", PAIR, 1, "f1"), recv("c", PAIR, 1, "b0")), wait("b0")],
               1: [(send("c", PAIR, 0, "b0"), recv("c", PAIR, 0, "f1")), wait("f1")]}
    assert replay(grouped, ALL_RULES).completed


def test_transfers_matched_out_of_order_are_reported():
    res = replay({0: [send("c", PAIR, 1, "a"), send("c", PAIR, 1, "b")],
                  1: [recv("c", PAIR, 0, "b"), recv("c", PAIR, 0, "a"), wait("a"), wait("b")]}, STREAMS)
    assert len(res.mismatches) == 2


def test_a_wait_names_its_op_by_ref():
    """Recorded runs give every op its own ``ref`` (two transfers of one shape share a ``key``): a wait for
    the second must not be satisfied by the first."""
    k = ((2, 3), "float32")
    ops = {0: [recv("c", PAIR, 1, k, ref="r1"), recv("d", PAIR, 1, k, ref="r2"), wait("r2")],
           1: [send("c", PAIR, 0, k, ref="s1")]}
    res = replay(ops, STREAMS)
    assert not res.completed and "recv" in res.blocked[0] and "on d" in res.blocked[0]


def test_the_rules_are_monotone_on_random_programs():
    """The certificate relies on it: whatever completes under every rule completes under each subset.
    200 random two- and three-rank programs of sends, receives, collectives, waits and creations
    (seeded: the same programs every run); at least a fifth complete under every rule, and some hang
    only under a rule -- the check is not vacuous."""
    rng = random.Random(39)
    subsets = [Rules(lazy_init=a, one_queue=b, eager_sends=c) for a, b, c in itertools.product((False, True), repeat=3)]
    all_done = some_hang = 0
    for _ in range(200):
        programs = _random_programs(rng)
        results = {rules: replay(programs, rules).completed for rules in subsets}
        if results[ALL_RULES]:
            all_done += 1
            assert all(results.values()), programs
        elif results[STREAMS]:
            some_hang += 1
    assert all_done >= 40 and some_hang >= 10, (all_done, some_hang)


def _random_programs(rng: random.Random) -> dict[int, list[Call]]:
    """Random matched transfers between ranks on a few communicators, each waited for (or not)."""
    ranks = list(range(rng.choice((2, 3))))
    comms = [(f"c{i}", tuple(rng.sample(ranks, 2))) for i in range(3)]
    programs: dict[int, list[Call]] = {r: [] for r in ranks}
    for n in range(rng.randint(2, 6)):
        name, (a, b) = rng.choice(comms)
        members = tuple(sorted((a, b)))
        key = f"t{n}"
        for r, call in ((a, send(name, members, b, key)), (b, recv(name, members, a, key))):
            at = rng.randint(0, len(programs[r]))
            programs[r].insert(at, call)
            if rng.random() < 0.7:
                programs[r].insert(rng.randint(at + 1, len(programs[r])), wait(key))
    return programs
