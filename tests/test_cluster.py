"""Issue 14, "Must hold": several ``dispach serve`` nodes on one log, against a real 3-server NATS
cluster with JetStream (tests/cluster.py) and the test Postgres. Only public surfaces: processes
and signals, the HTTP API, the log (read-only), the nodes' logs and /metrics.

Every node runs with a lease TTL of ``LEASE_TTL`` (3 s). The fake model answers as each message
asks (tests/cluster.py, ``SlowModel``): ``delay=`` seconds before its first reply, a call of the
mutating ``record`` tool (which writes one line per run to a file) working ``wait=`` seconds,
``after=`` seconds before the final reply. Measured failover times are printed (``-s``).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime

import pytest

from tests import fakes
from tests.cluster import (
    LEASE_TTL,
    Deployment,
    Row,
    Sent,
    children_of,
    deployment,
    nats_cluster,
    socket_holder,
)
from tests.fakes.telegram_server import FakeTelegram

fake_anthropic = fakes.fake_anthropic
__all__ = ["deployment", "fake_anthropic", "nats_cluster"]  # fixtures, used by name

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

WORKLOAD = "work delay=0.3 tool=record wait=2.5 after=0.3"
"""A turn that spends most of its time in a mutating tool call: a kill lands in one."""


# --- what the log must show --------------------------------------------------------------------


async def send_all(
    deployment: Deployment, nodes: Sequence[str], sessions: Sequence[str], text: str = WORKLOAD,
    agent: str = "worker",
) -> list[Sent]:  # fmt: skip
    """One message per entry of ``sessions`` (a session listed twice gets two), all at once,
    spread round-robin over ``nodes``."""
    posts = [
        deployment.post(nodes[i % len(nodes)], agent, text, session)
        for i, session in enumerate(sessions)
    ]
    return list(await asyncio.gather(*posts))


def accepted(sent: Iterable[Sent]) -> list[str]:
    return [s.turn_id for s in sent if s.status == 202 and s.turn_id is not None]


def all_accepted(sent: Sequence[Sent], deployment: Deployment) -> list[str]:
    """The turn ids, asserting every message was accepted (the cluster had settled)."""
    refused = Counter((s.status, s.code) for s in sent if s.status != 202)
    assert not refused, f"refused: {dict(refused)}\n{deployment.tails()}"
    return accepted(sent)


async def assert_each_ended_once(deployment: Deployment, turn_ids: Sequence[str]) -> None:
    """Exactly one ``turn.end`` per accepted turn, and no turn in the log but those."""
    ends = await deployment.log.turn_ends()
    wrong = {t: ends.get(t, 0) for t in turn_ids if ends.get(t, 0) != 1}
    assert wrong == {}, f"turn.end count per turn: {wrong}"
    starts = Counter(str(r.turn_id) for r in await deployment.log.rows(["turn.start"]))
    assert set(starts) == set(turn_ids), set(starts) ^ set(turn_ids)
    assert all(n == 1 for n in starts.values()), starts


async def assert_no_call_ran_twice(deployment: Deployment) -> list[Row]:
    """Every mutating call ran at most once (its file lines), every ``tool.call`` has exactly
    one ``tool.result``, and a result that is not ``uncertain`` is of a call that ran. Returns
    the results."""
    runs = deployment.tool_runs()
    twice = {call: n for call, n in runs.items() if n > 1}
    assert twice == {}, f"mutating calls run more than once: {twice}"
    calls = await deployment.log.rows(["tool.call"])
    results = await deployment.log.rows(["tool.result"])
    per_call = Counter(str(r.data["callId"]) for r in results)
    assert {str(c.data["callId"]) for c in calls} == set(per_call)
    assert all(n == 1 for n in per_call.values()), per_call
    for result in results:
        if not result.data.get("uncertain"):
            assert runs[str(result.data["callId"])] == 1, result
    return results


async def attempts(deployment: Deployment, turn_ids: Iterable[str]) -> dict[str, list[Row]]:
    """The attempts of each turn, in log order: its ``turn.start`` when the accept began the
    first one (catalogue v2: ``attempt`` 1 and the ``node``), then its ``turn.attempt`` events."""
    found: dict[str, list[Row]] = {}
    for row in await deployment.log.rows(["turn.start", "turn.attempt"], turn_ids):
        if row.type == "turn.attempt" or row.data.get("attempt"):
            found.setdefault(str(row.turn_id), []).append(row)
    return found


async def running_on(deployment: Deployment, node: str, turn_ids: Iterable[str]) -> set[str]:
    """The turns whose latest attempt is ``node``'s and that have not ended."""
    ids = list(turn_ids)
    ended = await deployment.log.ended(ids)
    latest = {t: rows[-1].data["node"] for t, rows in (await attempts(deployment, ids)).items()}
    return {t for t, n in latest.items() if n == node and t not in ended}


def now() -> datetime:
    return datetime.now(UTC)


# --- smoke -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_two_nodes_come_up_on_the_nats_cluster_and_each_ends_a_turn(
    deployment: Deployment,
) -> None:
    await deployment.start("n1", "n2")
    first, second = await asyncio.gather(
        deployment.post("n1", "worker", "hello delay=0.2", "smoke-1"),
        deployment.post("n2", "worker", "hello delay=0.2", "smoke-2"),
    )
    assert (first.status, second.status) == (202, 202), (first, second, deployment.tails())
    for sent in (first, second):
        assert sent.turn_id is not None
        turn = await deployment.wait_turn_end(sent.node, sent.turn_id)
        assert (turn["status"], turn["text"]) == ("final", "done"), turn
    assert await deployment.log.turn_ends() == {first.turn_id: 1, second.turn_id: 1}


# --- a. one session, two nodes, the same instant -----------------------------------------------


async def two_at_once(deployment: Deployment, agent: str, delay: float) -> tuple[Sent, Sent]:
    await deployment.start("n1", "n2")
    await deployment.wait_owned(["n1", "n2"], via="n1")
    first, second = await asyncio.gather(
        deployment.post("n1", agent, f"one delay={delay}", "contended"),
        deployment.post("n2", agent, f"two delay={delay}", "contended"),
    )
    return first, second


async def in_start_order(deployment: Deployment, turn_ids: Iterable[str]) -> list[str]:
    return [str(r.turn_id) for r in await deployment.log.rows(["turn.start"], turn_ids)]


@pytest.mark.asyncio
async def test_queue_runs_two_messages_sent_at_once_through_two_nodes_one_after_the_other(
    deployment: Deployment,
) -> None:
    sent = await two_at_once(deployment, "worker", 1.5)
    turn_ids = all_accepted(sent, deployment)
    await deployment.wait_all_ended(turn_ids, 30)
    await assert_each_ended_once(deployment, turn_ids)
    earlier, later = await in_start_order(deployment, turn_ids)
    rows = await deployment.log.rows(["model.call", "turn.end"], turn_ids)
    (end,) = [r for r in rows if r.turn_id == earlier and r.type == "turn.end"]
    later_calls = [r for r in rows if r.turn_id == later and r.type == "model.call"]
    assert later_calls, rows
    assert later_calls[0].position > end.position, (
        f"the queued turn called the model (position {later_calls[0].position}) before the "
        f"first ended (position {end.position}): the turns overlapped"
    )
    assert [r.data["reason"] for r in rows if r.type == "turn.end"] == ["final", "final"]


@pytest.mark.asyncio
async def test_reject_answers_the_second_of_two_messages_sent_at_once_409_session_busy(
    deployment: Deployment,
) -> None:
    sent = await two_at_once(deployment, "rejecter", 3)
    statuses = sorted((s.status, s.code) for s in sent)
    assert statuses == [(202, None), (409, "session_busy")], (sent, deployment.tails())
    (turn_id,) = accepted(sent)
    await deployment.wait_all_ended([turn_id], 30)
    await assert_each_ended_once(deployment, [turn_id])


@pytest.mark.asyncio
async def test_interrupt_stops_the_first_of_two_messages_sent_at_once(
    deployment: Deployment,
) -> None:
    sent = await two_at_once(deployment, "interrupter", 3)
    turn_ids = all_accepted(sent, deployment)
    await deployment.wait_all_ended(turn_ids, 30)
    await assert_each_ended_once(deployment, turn_ids)
    earlier, later = await in_start_order(deployment, turn_ids)
    reasons = {str(r.turn_id): r.data["reason"] for r in await deployment.log.rows(["turn.end"])}
    described = await deployment.log.describe(turn_ids)
    assert (reasons[earlier], reasons[later]) == ("stopped", "final"), (
        f"{reasons}\n{described}\n{deployment.tails()}"
    )


# --- b. kill -9 of one node of three -----------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_kill_9_of_one_of_three_nodes_loses_no_turn_and_runs_no_call_twice(
    deployment: Deployment,
) -> None:
    nodes = ["n1", "n2", "n3"]
    await deployment.start(*nodes)
    await deployment.wait_owned(nodes, via="n1")
    sessions = [f"load-{i // 2}" for i in range(100)]  # 100 turns over 50 sessions (queued)
    turn_ids = all_accepted(await send_all(deployment, nodes, sessions), deployment)
    victim = deployment.nodes["n2"]

    async def busy() -> bool:
        return deployment.runs_on("n2") >= 5

    await deployment.wait(busy, 60, "n2 to be running tool calls")
    victim.kill()
    killed_at = now()
    assert await victim.wait(10) == -9
    stranded = await running_on(deployment, "n2", turn_ids)
    assert stranded, "no turn was running on the killed node"

    await deployment.wait_all_ended(turn_ids, 120)

    await assert_each_ended_once(deployment, turn_ids)
    results = await assert_no_call_ran_twice(deployment)
    uncertain = [r for r in results if r.data.get("uncertain")]
    assert uncertain, "no call was in doubt: the kill landed in no tool call"
    assert {str(r.turn_id) for r in uncertain} <= stranded
    tried = await attempts(deployment, stranded)
    for turn_id in stranded:
        assert tried[turn_id][-1].data["node"] != "n2", tried[turn_id]
    ends = await deployment.log.rows(["turn.end"], stranded)
    delays = sorted((r.at - killed_at).total_seconds() for r in ends)
    print(f"\nkill -9 -> first resumed turn.end {delays[0]:.2f} s, last {delays[-1]:.2f} s "
          f"({len(stranded)} turns stranded, {len(uncertain)} calls uncertain, "
          f"TTL {LEASE_TTL:g} s)")  # fmt: skip
    assert delays[0] <= LEASE_TTL + 2, f"failover took {delays[0]:.2f} s"


# --- b'. two workers behind one port ---------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_two_workers_behind_one_port_both_serve_and_a_killed_one_loses_nothing(
    deployment: Deployment,
) -> None:
    parent = deployment.spawn("w", args=("serve", "--workers", "2"))
    await parent.wait_ready(90)
    workers = ["w-w1", "w-w2"]
    await deployment.wait_owned(workers, via="w")
    turn_ids = all_accepted(
        await send_all(deployment, ["w"], [f"workers-{i}" for i in range(40)]), deployment
    )
    pids = children_of(parent.pid)
    assert len(pids) == 2, pids

    async def both_running() -> bool:
        return {p for _, _, p in deployment.tool_lines()} == pids

    await deployment.wait(both_running, 60, "both workers to be running tool calls")
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)

    await deployment.wait_all_ended(turn_ids, 120)
    await assert_each_ended_once(deployment, turn_ids)
    await assert_no_call_ran_twice(deployment)
    ran_on = {rows[-1].data["node"] for rows in (await attempts(deployment, turn_ids)).values()}
    assert ran_on <= set(workers), ran_on

    async def restarted() -> bool:
        return len(children_of(parent.pid)) == 2 and victim not in children_of(parent.pid)

    await deployment.wait(restarted, 30, "the parent to restart the killed worker")
    assert parent.alive


# --- c. a node paused past its lease -----------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_node_paused_past_its_lease_is_fenced_and_its_turns_end_once_elsewhere(
    deployment: Deployment,
) -> None:
    nodes = ["n1", "n2", "n3"]
    await deployment.start(*nodes)
    await deployment.wait_owned(nodes, via="n2")
    sessions = [f"paused-{i}" for i in range(30)]
    turn_ids = all_accepted(await send_all(deployment, nodes, sessions), deployment)
    paused = deployment.nodes["n1"]

    async def busy() -> bool:
        return deployment.runs_on("n1") >= 3

    await deployment.wait(busy, 60, "n1 to be running tool calls")
    paused.pause()
    paused_at = now()
    try:
        stranded = await running_on(deployment, "n1", turn_ids)
        assert stranded, "no turn was running on the paused node"

        async def taken_over() -> bool:
            view = await deployment.nodes["n2"].cluster_view()
            return all(lease["node"] != "n1" for lease in view.get("leases") or [])

        took = await deployment.wait(taken_over, LEASE_TTL + 10, "n1's partitions taken over")
        print(f"\nSIGSTOP -> n1's leases gone from n2's view in {took:.2f} s")
        # Held until well past the TTL: by now its tool calls are overdue, and appending their
        # results is the first thing it tries when it runs again.
        await asyncio.sleep(max(0.0, LEASE_TTL + 1 - (now() - paused_at).total_seconds()))

        # And until the new owners have resumed its turns: a partition not yet opened when n1
        # runs again may be handed back to it by the rebalance before anyone else resumed them.
        async def resumed_elsewhere() -> bool:
            tried = await attempts(deployment, stranded)
            return all(
                any(r.at > paused_at and r.data["node"] != "n1" for r in tried.get(t, []))
                for t in stranded
            )

        await deployment.wait(resumed_elsewhere, 60, "n1's turns resumed on the other nodes")
    finally:
        paused.resume()

    await deployment.wait_all_ended(turn_ids, 90)
    await paused.wait_ready(30)

    await assert_each_ended_once(deployment, turn_ids)
    await assert_no_call_ran_twice(deployment)
    tried = await attempts(deployment, stranded)
    for turn_id in stranded:
        after = [r for r in tried[turn_id] if r.at > paused_at]
        assert after and after[-1].data["node"] != "n1", (turn_id, tried[turn_id])
    refusals = await paused.metric("dispach_fence_refusals_total")
    lost = [e for e in paused.log_events() if e.get("event") == "lease_lost"]
    print(f"n1 after SIGCONT: dispach_fence_refusals_total={refusals:g}, "
          f"{len(lost)} lease_lost lines")  # fmt: skip
    assert refusals > 0, (
        f"n1 appended nothing the fence refused (dispach_fence_refusals_total={refusals}); "
        f"its lease_lost lines: {lost[:5]}"
    )


# --- d. one NATS server of three killed --------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_one_nats_server_of_three_killed_under_load_loses_no_accepted_turn(
    deployment: Deployment,
) -> None:
    nodes = ["n1", "n2", "n3"]
    await deployment.start(*nodes)
    await deployment.wait_owned(nodes, via="n1")
    first = await send_all(deployment, nodes, [f"outage-{i}" for i in range(30)])
    turn_ids = all_accepted(first, deployment)

    async def busy() -> bool:
        return len(deployment.tool_lines()) >= 10

    await deployment.wait(busy, 60, "tool calls running")
    busiest = await asyncio.to_thread(deployment.nats.busiest)
    deployment.nats.kill(busiest)
    # More messages while the cluster recovers: those it accepts must end too.
    during = await send_all(deployment, nodes, [f"during-{i}" for i in range(15)])
    turn_ids += accepted(during)
    print(f"\nNATS server {busiest} killed; during the outage "
          f"{Counter((s.status, s.code) for s in during)}")  # fmt: skip

    await deployment.wait_all_ended(turn_ids, 120)
    for node in nodes:
        await deployment.nodes[node].wait_ready(30)
    await assert_each_ended_once(deployment, turn_ids)
    await assert_no_call_ran_twice(deployment)
    after = await send_all(deployment, nodes, [f"after-{i}" for i in range(3)], "again")
    late = all_accepted(after, deployment)
    await deployment.wait_all_ended(late, 30)
    deployment.nats.start(busiest)
    await deployment.nats.await_formed()


# --- e. commands sent to a node that does not own the session ----------------------------------


@pytest.mark.asyncio
async def test_stop_grant_and_clear_through_a_node_that_does_not_own_the_session(
    deployment: Deployment,
) -> None:
    await deployment.start("n1", "n2")
    await deployment.wait_owned(["n1", "n2"], via="n1")
    await deployment.wait_owned(["n1", "n2"], via="n2")  # what n2 routes by
    stopped_key = await deployment.session_owned_by("worker", "n1", via="n2", prefix="stop")
    gated_key = await deployment.session_owned_by("worker", "n1", via="n2", prefix="gate")
    other = deployment.nodes["n2"]

    # stop
    slow = await deployment.post("n1", "worker", "delay=30", stopped_key)
    assert slow.status == 202 and slow.turn_id is not None, slow

    async def calling() -> bool:
        return bool(await deployment.log.rows(["model.call"], [str(slow.turn_id)]))

    await deployment.wait(calling, 20, "the slow turn to call the model")
    stop = await deployment.http.post(f"{other.url}/v1/agents/worker/turns/{slow.turn_id}/stop")
    assert stop.status_code == 202, stop.text
    turn = await deployment.wait_turn_end("n2", slow.turn_id, 15)
    assert turn["status"] == "stopped", turn

    # approval
    gated = await deployment.post("n1", "worker", "tool=gated wait=0", gated_key)
    assert gated.status == 202 and gated.turn_id is not None, gated
    pending: list[dict[str, object]] = []

    async def asked() -> bool:
        listed = (await other.get("/v1/agents/worker/approvals")).json()["approvals"]
        pending[:] = [a for a in listed if a["turnId"] == gated.turn_id]
        return bool(pending)

    await deployment.wait(asked, 20, "the approval request")
    grant = await deployment.http.post(
        f"{other.url}/v1/agents/worker/approvals/{pending[0]['approvalId']}",
        json={"granted": True},
    )
    assert grant.status_code == 200, grant.text
    turn = await deployment.wait_turn_end("n2", gated.turn_id, 20)
    assert turn["status"] == "final", turn
    assert [t for t, _, _ in deployment.tool_lines()] == [gated.turn_id], "the call ran once"

    # clear
    cleared = await deployment.http.delete(f"{other.url}/v1/agents/worker/sessions/{gated_key}")
    assert cleared.status_code == 200, cleared.text
    assert cleared.json() == {"cleared": gated_key, "memoryFilesKept": True,
                              "reset": ["history", "notes", "phase"]}  # fmt: skip
    marks = [r for r in await deployment.log.rows(["session.cleared"])
             if r.session_key == gated_key]  # fmt: skip
    assert len(marks) == 1, marks


# --- f. a node joins; a node leaves on SIGTERM -------------------------------------------------


async def assert_nothing_resumed(deployment: Deployment, turn_ids: Sequence[str]) -> None:
    """Ownership moved between turns: every turn ran in one attempt, no call was in doubt."""
    tried = await attempts(deployment, turn_ids)
    again = {t: [r.data["node"] for r in rows] for t, rows in tried.items() if len(rows) != 1}
    assert again == {}, f"turns run more than once: {again}"
    results = await assert_no_call_ran_twice(deployment)
    assert not [r for r in results if r.data.get("uncertain")]


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_joining_node_takes_partitions_without_any_turn_running_twice(
    deployment: Deployment,
) -> None:
    await deployment.start("n1", "n2")
    await deployment.wait_owned(["n1", "n2"], via="n1")
    first = await send_all(deployment, ["n1", "n2"], [f"before-{i}" for i in range(30)])
    turn_ids = all_accepted(first, deployment)

    async def busy() -> bool:
        return len(deployment.tool_lines()) >= 10

    await deployment.wait(busy, 60, "tool calls running")
    await deployment.start("n3")
    view = await deployment.wait_owned(["n1", "n2", "n3"], via="n1", timeout=60)
    joined = await send_all(deployment, ["n1", "n2", "n3"], [f"after-{i}" for i in range(20)])
    turn_ids += accepted(joined)
    await deployment.wait_all_ended(turn_ids, 90)

    await assert_each_ended_once(deployment, turn_ids)
    await assert_nothing_resumed(deployment, turn_ids)
    taken = sum(1 for lease in view["leases"] if lease["node"] == "n3")
    ran = {r.data["node"] for rows in (await attempts(deployment, turn_ids)).values()
           for r in rows}  # fmt: skip
    assert taken > 0 and "n3" in ran, (taken, ran)


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_sigterm_hands_the_partitions_over_and_exits_0_with_every_turn_finished(
    deployment: Deployment,
) -> None:
    nodes = ["n1", "n2", "n3"]
    await deployment.start(*nodes)
    await deployment.wait_owned(nodes, via="n1")
    sessions = [f"leaving-{i}" for i in range(45)] + [f"leaving-{i}" for i in range(15)]
    turn_ids = all_accepted(await send_all(deployment, nodes, sessions), deployment)
    leaving = deployment.nodes["n3"]

    async def busy() -> bool:
        return deployment.runs_on("n3") >= 3

    await deployment.wait(busy, 60, "n3 to be running tool calls")
    leaving.terminate()
    try:
        code = await leaving.wait(60)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{deployment.tails()}") from None
    assert code == 0, deployment.tails()
    await deployment.wait_owned(["n1", "n2"], via="n1", timeout=30)
    await deployment.wait_all_ended(turn_ids, 90)

    await assert_each_ended_once(deployment, turn_ids)
    await assert_nothing_resumed(deployment, turn_ids)


# --- g. singletons -----------------------------------------------------------------------------

TICKER = """
id: ticker
model: {provider: scripted}
schedules:
  - {id: beat, kind: every, expr: 1s, task: ping, deliver: none}
"""


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_one_scheduler_clock_across_three_nodes_makes_one_turn_per_tick(
    deployment: Deployment,
) -> None:
    deployment.write_agent("ticker", TICKER)
    nodes = ["n1", "n2", "n3"]
    await deployment.start(*nodes)
    await deployment.wait_owned(nodes, via="n1")
    since = now()
    fired: list[Row] = []

    async def ticks() -> bool:
        rows = await deployment.log.rows(["schedule.fired"])
        fired[:] = [r for r in rows if datetime.fromisoformat(r.data["due"]) > since]
        return len(fired) >= 6

    await deployment.wait(ticks, 30, "six ticks with three nodes up")
    dues = Counter(r.data["due"] for r in fired)
    assert all(n == 1 for n in dues.values()), dues
    starts = [r for r in await deployment.log.rows(["turn.start"]) if r.agent_id == "ticker"]
    per_session = Counter(r.session_key for r in starts)
    assert all(n == 1 for n in per_session.values()), per_session
    assert {r.data["turnId"] for r in fired} <= {str(r.turn_id) for r in starts}
    # One clock: each tick was submitted by one node's scheduler, never answered as a replay
    # of another node's submission.
    firing = {str(r.data["turnId"]) for r in fired}
    logged = [(n, e) for n in nodes for e in deployment.nodes[n].log_events()
              if e.get("event") == "schedule_fired" and e.get("turn") in firing]  # fmt: skip
    by_node = Counter(n for n, _ in logged)
    replays = [e for _, e in logged if e.get("replayed")]
    assert len(by_node) == 1 and not replays, (dict(by_node), replays[:3])


TOKEN = "7000000001:test-token"  # the fake Bot API's token
TELLER = """
id: teller
model: {{provider: scripted}}
channels:
  - id: tg
    type: telegram
    token_env: DISPACH_TEST_TELEGRAM_TOKEN
    api_base_url: "{url}"
    allow_from: ["*"]
    poll_timeout_s: 1
    backoff_s: [0.05, 0.1]
"""


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_one_telegram_poller_per_bot_across_three_nodes(deployment: Deployment) -> None:
    nodes = ["n1", "n2", "n3"]
    with FakeTelegram(TOKEN) as telegram:
        port = int(telegram.url.rsplit(":", 1)[1])

        def caller(peer: tuple[str, int]) -> str | None:
            pids = {n: node.pid for n, node in deployment.nodes.items() if node.alive}
            return socket_holder(peer[1], port, pids)

        telegram.identify = caller
        deployment.write_agent("teller", TELLER.format(url=telegram.url))
        await deployment.start(*nodes, DISPACH_TEST_TELEGRAM_TOKEN=TOKEN)
        await deployment.wait_owned(nodes, via="n1")
        mark = len(telegram.calls("getUpdates"))

        async def polled() -> bool:
            return len(telegram.calls("getUpdates")) >= mark + 6

        await deployment.wait(polled, 30, "six polls with three nodes up")
        callers = Counter(c.caller for c in telegram.calls("getUpdates")[mark:])
        assert len(callers) == 1 and None not in callers, dict(callers)

        telegram.push_message(4711, "hello over telegram")
        await asyncio.to_thread(telegram.wait_for_sent, 1, 20.0)
        turns = [r for r in await deployment.log.rows(["turn.start"]) if r.agent_id == "teller"]
        assert len(turns) == 1, turns
