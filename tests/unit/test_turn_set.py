"""The turn sets' shape (tests/turn_set.py): what bench/smart_turn.py --replay and bench/latency.py
count cut-ins over. No audio is rendered here."""

from tests.turn_set import PAUSES_MS, PIPER_TURNS, TURNS, turn_set


def test_the_piper_set_keeps_every_english_item_of_the_espeak_set_unchanged():
    english = [item for item in TURNS if item.language == "en"]
    assert all(item in PIPER_TURNS for item in english)
    assert {item.language for item in PIPER_TURNS} == {"en"}
    assert turn_set("espeak") is TURNS and turn_set("piper") is turn_set("piper-turn") is PIPER_TURNS


def test_names_are_unique_and_say_what_each_turn_is():
    for items in (TURNS, PIPER_TURNS):
        assert len({item.name for item in items}) == len(items)
        assert all(("-paused-" in item.name) == item.paused for item in items)


def test_paused_turns_hold_the_floor_at_each_pause_and_end_at_their_last_part():
    for item in TURNS + PIPER_TURNS:
        assert len(item.pauses_ms) == len(item.parts) - 1
        assert set(item.pauses_ms) <= set(PAUSES_MS)
        assert all(part.endswith((",", "，")) for part in item.parts[:-1]), item.name
        assert not item.parts[-1].endswith((",", "，")), item.name


def test_each_half_of_the_piper_set_has_at_least_60_paused_turns():
    # bench/turn_offline.py alternates a group's turns between the halves (tuned on 0, reported on 1).
    paused = [item for item in PIPER_TURNS if item.paused]
    assert len(paused[0::2]) >= 60 and len(paused[1::2]) >= 60
    assert sum(not item.paused for item in PIPER_TURNS) >= 60
