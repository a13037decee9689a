"""bench/latency.py's matching of the server's events to the turn they belong to, on recorded event
sequences of one client (no server): a loaded server's turn.end of one turn, and its reply, landing
inside the next turn are late, never that turn's cut-in or its reply."""

from __future__ import annotations

from bench.latency import CHAIN, DECISION, LEAD_S, EventLog, result, stages
from tests.turn_set import TurnItem

COMPLETE = TurnItem("en-complete-00", "en", ("I would like to order a pizza.",), ())
PAUSED = TurnItem("en-paused-00", "en", ("I would like to,", "order a pizza."), (0.6,))


def turn_end(utterance: str, by: str = "smart") -> dict:
    return {"type": "turn.end", "utterance_id": utterance, "by": by, "probability": 0.9, "text": "x",
            "timings": {"pause_ms": 200, "end_of_speech_ms": 250.0}}


def reply(log: EventLog, at: float, reply_id: str, frames: int = 2) -> None:
    log.append(at, {"type": "reply.done", "reply_id": reply_id, "text": "x"})
    log.append(at, {"type": "audio.start", "reply_id": reply_id})
    for i in range(frames):
        log.append(at + 0.01 + 0.2 * i, None)


def first_turn(log: EventLog) -> None:
    """Turn 1 (u1), spoken from 0.4 s to its end at 2.0 s."""
    log.append(0.6, {"type": "speech.started", "utterance_id": "u1"})
    log.append(2.5, {"type": "asr.final", "utterance_id": "u1", "text": "x"})


def test_a_late_turn_end_of_the_previous_turn_is_late_not_a_cut_in():
    log = EventLog()
    first_turn(log)  # its turn.end and reply come only inside turn 2: the server is backlogged
    log.append(8.6, {"type": "speech.started", "utterance_id": "u2"})
    log.append(9.0, turn_end("u1"))  # turn 2 began at 8.0 and ends at 10.0: this one is turn 1's
    reply(log, 9.2, "r1")
    log.append(10.3, turn_end("u2"))
    reply(log, 10.5, "r2")

    second = result(log, COMPLETE, 8.0, 10.0, log.first_frame(8.0, 10.0))
    assert not second.cut_in and second.cut_ins == []
    assert second.late_turn_ends == 1
    assert second.ended_by == ["smart"]
    assert round(second.first_audio_ms) == 510  # its own reply's first frame, from its end
    assert round(second.turn_end_ms) == 300


def test_a_late_reply_after_the_end_is_not_this_turns_reply():
    log = EventLog()
    first_turn(log)
    log.append(8.6, {"type": "speech.started", "utterance_id": "u2"})
    log.append(10.2, turn_end("u1"))  # turn 1's turn.end and reply, both after turn 2's end
    reply(log, 10.4, "r1")

    assert log.first_frame(8.0, 10.0) is None
    second = result(log, COMPLETE, 8.0, 10.0, None)
    assert second.first_audio_ms is None and second.late_turn_ends == 1
    assert second.fate == "no asr.final"  # turn 1's transcript is not turn 2's

    log.append(11.0, turn_end("u2"))
    reply(log, 11.1, "r2")
    assert round((log.first_frame(8.0, 10.0) - 10.0) * 1000) == 1110


def test_the_turns_own_turn_end_before_its_end_is_a_cut_in():
    log = EventLog()
    log.append(0.6, {"type": "speech.started", "utterance_id": "u1"})
    log.append(1.4, turn_end("u1", by="silence"))  # the pause inside the turn ended it
    reply(log, 1.5, "r1")
    log.append(1.8, {"type": "speech.started", "utterance_id": "u2"})
    log.append(2.9, turn_end("u2", by="silence"))
    reply(log, 3.0, "r2")

    turn = result(log, PAUSED, 0.0, 2.5, log.first_frame(0.0, 2.5))
    assert turn.cut_in and turn.cut_ins == ["silence p=0.9 at 200 ms"]
    assert turn.late_turn_ends == 0
    assert turn.ended_by == ["silence", "silence"]
    assert round(turn.first_audio_ms) == 510  # the reply that started after the end


def test_a_paused_turn_is_its_own_through_its_last_utterance():
    log = EventLog()
    log.append(0.6, {"type": "speech.started", "utterance_id": "u3"})
    log.append(1.8, {"type": "speech.started", "utterance_id": "u4"})
    log.append(2.8, turn_end("u4"))  # a turn.end names the turn's last utterance
    reply(log, 3.0, "r1")

    turn = result(log, PAUSED, 0.0, 2.5, log.first_frame(0.0, 2.5))
    assert not turn.cut_in and turn.late_turn_ends == 0 and turn.ended_by == ["smart"]
    assert round(turn.first_audio_ms) == 510


def test_a_turn_the_server_never_heard_is_told_apart_from_the_late_events_it_got():
    log = EventLog()
    first_turn(log)
    log.append(9.0, turn_end("u1"))
    reply(log, 9.2, "r1")

    turn = result(log, COMPLETE, 8.0, 10.0, log.first_frame(8.0, 10.0))
    assert turn.first_audio_ms is None
    assert turn.fate == "no speech heard"
    assert turn.late_turn_ends == 1 and not turn.cut_in


def test_a_turn_end_before_the_first_word_is_not_a_cut_in():
    log = EventLog()
    log.append(0.1, {"type": "speech.started", "utterance_id": "u1"})  # a noise in the lead-in silence
    log.append(LEAD_S - 0.1, turn_end("u1"))
    turn = result(log, COMPLETE, 0.0, 2.0, None)
    assert not turn.cut_in and turn.late_turn_ends == 0


def test_a_reply_is_the_turns_whose_turn_end_came_last_before_it():
    log = EventLog()
    first_turn(log)
    log.append(1.9, turn_end("u1"))
    log.append(2.1, {"type": "reply.delta", "reply_id": "r1", "text": "x"})  # r1 began before turn 2's turn.end
    log.append(8.6, {"type": "speech.started", "utterance_id": "u2"})
    log.append(10.2, turn_end("u2"))
    log.append(10.25, {"type": "error", "code": "reply_failed", "reply_id": "r1", "message": "dropped"})
    reply(log, 10.3, "r1")  # turn 1's reply, sent late: it is not turn 2's, and neither is its error
    log.append(10.4, {"type": "reply.done", "reply_id": "r2", "text": ""})

    assert log.replies(8.0) == {"r2"}
    assert log.first_frame(8.0, 10.0) is None
    assert result(log, COMPLETE, 8.0, 10.0, None).fate == "turn.end ['x'], empty reply text"


def test_a_turns_hops_add_up_to_its_end_to_first_frame():
    """From the client's clock (turn.end and the first frame) and the server's timings of the turn's
    last utterance: every hop is measured, none is left over."""
    log = EventLog()
    log.append(0.6, {"type": "speech.started", "utterance_id": "u1"})
    log.append(2.58, {"type": "asr.final", "utterance_id": "u1", "text": "x",
                      "timings": {"endpoint_delay_ms": 540.0, "asr_final_ms": 12.0}})
    end = {**turn_end("u1"), "timings": {"pause_ms": 512, "asked_ms": 190.0, "queued_ms": 0.0, "model_ms": 80.0,
                                         "decision_ms": 90.0, "end_of_speech_ms": 600.0}}
    log.append(2.64, end)  # the turn ended at 2.0: turn.end 640 ms after it, 600 after the VAD's speech end
    reply(log, 2.66, "r1")
    r = result(log, COMPLETE, 0.0, 2.0, log.first_frame(0.0, 2.0))
    hops = stages(r)
    assert [round(hops[name]) for name in CHAIN] == [40, 540, 12, 48, 30]
    assert round(sum(hops[name] for name in CHAIN)) == round(r.first_audio_ms) == 670
    assert [hops[name] for name in DECISION] == [190.0, 0.0, 80.0]


def test_a_turn_without_its_transcripts_timings_has_no_chain():
    log = EventLog()
    first_turn(log)  # its asr.final carries no timings
    log.append(2.64, turn_end("u1"))
    reply(log, 2.66, "r1")
    hops = stages(result(log, COMPLETE, 0.0, 2.0, log.first_frame(0.0, 2.0)))
    assert all(hops[name] is None for name in CHAIN)
    assert round(hops["end -> first frame"]) == 670
