"""The REST API over real ingest, on SQLite and on PostgreSQL.

Agents are real ZeroMQ DEALER sockets sending wire-encoded messages to an
embedded server; every answer is read back through HTTP.
"""

from __future__ import annotations

import httpx
import pytest

from nand import wire
from nand.events import FlightWindow
from tests.server.helpers import eventually


def _ddp_forward_fault(agents, run: str = "ddp", world: int = 4) -> list:
    ranks = [agents(run=run, rank=r, world_size=world) for r in range(world)]
    for a in ranks:
        a.hello()
        a.heartbeat(10, steps_per_s=4.0, loss=2.5, grad_norm=1.0)
    window = FlightWindow(
        steps=[8, 9, 10],
        modules=["enc.fc1", "enc.fc2"],
        act_max_abs=[[1.0, 2.0], [1.0, 2.5], [1.0, 3.0]],
        grad_max_abs=[],
        grad_norm=[1.0, 1.1, 1.0],
        loss=[2.6, 2.5, 2.5],
        dtype="float32",
        dtype_max=3.4e38,
    )
    ranks[2].event(
        step=11,
        phase="forward",
        module="enc.fc2",
        module_type="Linear",
        cause="produced",
        posinf=3,
        max=float("inf"),
        min=float("-inf"),
        shape=[8, 16],
        dtype="float32",
        flight=window,
    )
    for a in ranks:
        if a.rank != 2:
            a.event(step=11, phase="grad", module="enc.fc2.weight", cause="received", nan=128)
        a.event(step=11, phase="param", module="enc.fc2.weight", nan=128)
    for a in ranks:
        a.wait_acked()
    return ranks


def test_verdict_names_origin_rank_and_ranks_that_received_it(server, agents) -> None:
    _ddp_forward_fault(agents)
    verdict = httpx.get(f"{server.http_url}/api/runs/ddp/verdict").json()
    assert verdict["state"] == "diverged"
    assert verdict["origin"]["rank"] == 2
    assert verdict["origin"]["module"] == "enc.fc2"
    assert verdict["origin"]["phase"] == "forward"
    assert verdict["origin"]["posinf"] == 3
    assert verdict["ranks_affected"] == [0, 1, 2, 3]
    assert verdict["ranks_received"] == [0, 1, 3]
    assert verdict["simultaneous"] is False
    assert verdict["hint"] == "produced_in_layer"
    assert verdict["summary"].startswith(
        "rank 2 produced +inf x3 in enc.fc2 (Linear) during forward at step 11; "
        "the other 3 ranks received it through the gradient all-reduce."
    )
    assert verdict["since"] == verdict["origin"]["time"]


def test_run_list_detail_and_ranks(server, agents) -> None:
    _ddp_forward_fault(agents)
    runs = httpx.get(f"{server.http_url}/api/runs").json()
    assert [r["run"] for r in runs] == ["ddp"]
    assert runs[0]["state"] == "diverged" and runs[0]["ranks_seen"] == 4
    assert runs[0]["event_count"] == 8 and runs[0]["latest_step"] == 10
    detail = httpx.get(f"{server.http_url}/api/runs/ddp").json()
    assert detail["world_size"] == 4
    assert detail["optimizer"] == "AdamW" and detail["versions"] == {"torch": "2.13"}
    assert [m["name"] for m in detail["modules"]] == ["fc1", "fc2"]
    assert detail["verdict"]["origin"]["rank"] == 2
    ranks = httpx.get(f"{server.http_url}/api/runs/ddp/ranks").json()["items"]
    assert [r["relation"] for r in ranks] == ["received", "received", "origin", "received"]
    assert ranks[2]["first_event"]["max"] is None  # +inf is not JSON
    assert ranks[2]["first_event"]["shape"] == [8, 16]
    assert ranks[0]["host"] == "host-0" and ranks[0]["steps_per_s"] == 4.0
    assert {r["state"] for r in ranks} == {"diverged"}


def test_flight_defaults_to_the_origin_rank(server, agents) -> None:
    _ddp_forward_fault(agents)
    flight = httpx.get(f"{server.http_url}/api/runs/ddp/flight").json()
    assert flight["rank"] == 2 and flight["modules"] == ["enc.fc1", "enc.fc2"]
    assert flight["act_max_abs"][2] == [1.0, 3.0]
    missing = httpx.get(f"{server.http_url}/api/runs/ddp/flight", params={"rank": 0})
    assert missing.status_code == 404


def test_simultaneous_on_all_ranks(server, agents) -> None:
    ranks = [agents(run="sim", rank=r, world_size=8) for r in range(8)]
    for a in ranks:
        a.event(step=40, phase="forward", module="attn.softmax", module_type="Softmax", nan=2)
    for a in ranks:
        a.wait_acked()
    verdict = httpx.get(f"{server.http_url}/api/runs/sim/verdict").json()
    # No rank was first, and the data says so: no origin rank, every rank simultaneous.
    assert verdict["simultaneous"] is True and verdict["origin"]["rank"] is None
    assert verdict["origin"]["ranks"] == list(range(8))
    assert verdict["summary"].startswith("all 8 ranks went non-finite at the same point")
    ranks = httpx.get(f"{server.http_url}/api/runs/sim/ranks").json()["items"]
    assert {r["relation"] for r in ranks} == {"simultaneous"}
    runs = httpx.get(f"{server.http_url}/api/runs").json()
    assert next(r for r in runs if r["run"] == "sim")["origin"]["rank"] is None


def test_bad_data_on_one_rank_and_overflow_hint_from_flight(server, agents) -> None:
    a, b = agents(run="data", rank=0, world_size=2), agents(run="data", rank=1, world_size=2)
    b.event(step=3, phase="input", module="", cause="data", nan=1)
    a.event(step=3, phase="grad", module="fc.weight", nan=1)
    hot = FlightWindow(
        steps=[1, 2, 3],
        modules=["fc"],
        act_max_abs=[[10.0], [3e3], [4e4]],
        dtype="float16",
        dtype_max=65504.0,
    )
    c = agents(run="amp", rank=0)
    c.event(step=3, phase="forward", module="fc", module_type="Linear", posinf=1, flight=hot)
    for x in (a, b, c):
        x.wait_acked()
    data = httpx.get(f"{server.http_url}/api/runs/data/verdict").json()
    assert data["hint"] == "input_data" and data["origin"]["rank"] == 1
    amp = httpx.get(f"{server.http_url}/api/runs/amp/verdict").json()
    assert amp["hint"] == "overflow" and "float16 limit 65504" in amp["summary"]


def test_first_event_is_logical_not_arrival_order(server, agents) -> None:
    a = agents(run="late", rank=0)
    b = agents(run="late", rank=1)
    a.event(step=9, phase="forward", module="fc2", order=3)
    a.wait_acked()
    b.event(step=9, phase="forward", module="fc1", order=1)  # arrives later, happened earlier
    a.event(step=8, phase="grad", module="fc1.weight")  # even earlier, on rank 0
    a.wait_acked()
    b.wait_acked()
    verdict = httpx.get(f"{server.http_url}/api/runs/late/verdict").json()
    assert (verdict["origin"]["rank"], verdict["origin"]["step"]) == (0, 8)


def test_duplicates_are_acked_again_but_stored_once(server, agents) -> None:
    a = agents(run="dup")
    seq = a.event(step=1, phase="forward", module="fc")
    a.wait_acked({seq})
    a.acked.clear()
    again = a.message("event", {}, seq=seq)
    again["body"] = {
        "event": {
            "step": 1,
            "micro_step": 0,
            "phase": "forward",
            "module": "fc",
            "order": 0,
            "cause": "produced",
        },
        "flight": None,
    }
    for _ in range(3):
        a.send_raw(wire.encode(again))
    last = a.heartbeat(2)  # processed after the duplicates (one connection keeps order)
    a.wait_acked({seq, last})
    page = httpx.get(f"{server.http_url}/api/runs/dup/events").json()
    assert page["total"] == 1
    assert "nand_messages_duplicate_total 3.0" in httpx.get(f"{server.http_url}/metrics").text


def test_events_pagination_and_filters(server, agents) -> None:
    a, b = agents(run="page", rank=0), agents(run="page", rank=1)
    for step in range(10):
        a.event(step=step, phase="forward", module=f"m{step % 3}")
        b.event(step=step, phase="grad", module="m.weight")
    a.wait_acked()
    b.wait_acked()
    url = f"{server.http_url}/api/runs/page/events"
    page = httpx.get(url, params={"limit": 7, "offset": 0}).json()
    assert page["total"] == 20 and len(page["items"]) == 7
    keys = [(e["step"], e["phase"]) for e in page["items"]]
    assert keys[:3] == [(0, "forward"), (0, "grad"), (1, "forward")]
    rest = httpx.get(url, params={"limit": 100, "offset": 7}).json()["items"]
    assert len(rest) == 13
    assert {e["id"] for e in page["items"]}.isdisjoint(e["id"] for e in rest)
    only = httpx.get(url, params={"rank": 1, "step_min": 3, "step_max": 5}).json()
    assert only["total"] == 3 and {e["rank"] for e in only["items"]} == {1}
    assert httpx.get(url, params={"phase": "grad"}).json()["total"] == 10
    assert httpx.get(url, params={"module": "m1"}).json()["total"] == 3


@pytest.mark.parametrize(
    "params",
    [
        {"limit": 0},
        {"limit": 100000},
        {"offset": -1},
        {"phase": "sideways"},
        {"rank": "x"},
        {"step_min": -3},
        {"module": "a\x00b"},
    ],
)
def test_bad_event_params_are_422(server, agents, params) -> None:
    a = agents(run="p")
    a.event(step=1, phase="forward")
    a.wait_acked()
    assert httpx.get(f"{server.http_url}/api/runs/p/events", params=params).status_code == 422


def test_unknown_run_is_a_clear_404(server) -> None:
    for path in ("", "/verdict", "/ranks", "/events", "/series", "/flight"):
        response = httpx.get(f"{server.http_url}/api/runs/nope{path}")
        assert response.status_code == 404
        assert "unknown run 'nope'" in response.json()["detail"]


def test_series_is_downsampled_to_the_requested_points(server, agents) -> None:
    a = agents(run="series")
    for step in range(1, 201):
        a.heartbeat(step, loss=1.0 / step, grad_norm=float(step % 7), steps_per_s=3.0)
    a.wait_acked()
    full = httpx.get(f"{server.http_url}/api/runs/series/series", params={"points": 500}).json()
    assert len(full[0]["points"]) == 200
    small = httpx.get(f"{server.http_url}/api/runs/series/series", params={"points": 20}).json()
    points = small[0]["points"]
    assert len(points) == 20
    assert points[-1]["step"] == 200
    assert all(p["grad_norm"] == 6.0 for p in points[:-1])  # the max of each bucket


def test_health_states_finished_and_lost(start_server, agents) -> None:
    server = start_server(lost_after_s=1.0)
    from tests.server.agents import FakeAgent

    done = FakeAgent(server.zmq_endpoint, run="fin", rank=0)
    done.heartbeat(5)
    done.bye(5)
    done.wait_acked()
    quiet = FakeAgent(server.zmq_endpoint, run="quiet", rank=0)
    quiet.heartbeat(5)
    quiet.wait_acked()
    fin = httpx.get(f"{server.http_url}/api/runs/fin/verdict").json()
    assert fin["state"] == "finished" and fin["summary"].startswith("Finished at step 5")

    def lost() -> bool:
        return httpx.get(f"{server.http_url}/api/runs/quiet/verdict").json()["state"] == "lost"

    eventually(lost, timeout=5)
    ranks = httpx.get(f"{server.http_url}/api/runs/quiet/ranks").json()["items"]
    assert ranks[0]["state"] == "lost"
    done.close()
    quiet.close()


def test_stalled_when_heartbeats_show_no_progress(start_server) -> None:
    from tests.server.agents import FakeAgent

    server = start_server(stalled_after_s=0.5)
    a = FakeAgent(server.zmq_endpoint, run="stall")
    a.heartbeat(7)
    a.wait_acked()

    def stalled() -> bool:
        a.heartbeat(7)  # alive, no progress
        a.pump(0.05)
        return httpx.get(f"{server.http_url}/api/runs/stall/verdict").json()["state"] == "stalled"

    eventually(stalled, timeout=5)
    a.close()


def test_metrics_counts_rejections_by_reason_and_runs_by_state(server, agents) -> None:
    a = agents(run="m")
    a.send_raw(b"\xc1 not msgpack")
    a.send_raw(b"\x93\x01\x02\x03")  # a msgpack list
    a.event(step=1, phase="forward")
    a.wait_acked()
    text = httpx.get(f"{server.http_url}/metrics").text

    def has(line: str) -> bool:
        return line in httpx.get(f"{server.http_url}/metrics").text

    eventually(lambda: has('nand_messages_rejected_total{reason="not_msgpack"} 1.0'))
    assert 'nand_messages_rejected_total{reason="not_a_map"} 1.0' in text
    assert 'nand_runs{state="diverged"} 1.0' in text
    assert "nand_events_total 1.0" in text
    assert httpx.get(f"{server.http_url}/healthz").json()["status"] == "ok"


def test_gradient_explosion_hint_from_heartbeats_when_no_window(server, agents) -> None:
    a = agents(run="explode")
    for step, norm in enumerate([1.0, 2.0, 5.0, 40.0, 300.0, 2500.0], start=1):
        a.heartbeat(step, grad_norm=norm)
    a.event(step=7, phase="backward", module="fc2", module_type="Linear", posinf=1)
    a.wait_acked()
    verdict = httpx.get(f"{server.http_url}/api/runs/explode/verdict").json()
    assert verdict["hint"] == "gradient_explosion"
    assert "gradient norm rose from 1 to 2.5e+03 over steps 1-6" in verdict["summary"]
