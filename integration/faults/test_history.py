"""The history checker on synthetic histories: a clean one passes, and each rule catches the
history made to break it (and only the rules that history breaks)."""

from __future__ import annotations

import pytest

from .history import FINAL, History, digest, leader_overlaps, leader_tenures

BODIES = [f"batch {i}".encode() for i in range(6)]
D = [digest(b) for b in BODIES]


def clean() -> History:
    """Two writers on stream 1 (batches of 2 records), a tail that saw everything, and a final
    log that holds it all; w2's third batch was given up, and is not stored."""
    h = History()
    for i in range(5):
        writer = "w1" if i % 2 == 0 else "w2"
        h.record_sent(f"{writer}:{i}", writer, 1, D[i])
    for i in range(4):
        writer = "w1" if i % 2 == 0 else "w2"
        h.record_acked(f"{writer}:{i}", 2 * i, 0)
    h.record_failed("w1:4", "TransportError: gone")
    for i in range(4):
        h.record_seen("tail", 1, 2 * i, 2, D[i], "198.18.0.10:1")
    h.record_final(1, [(2 * i, 2, D[i]) for i in range(4)])
    return h


def broken(h: History) -> set[str]:
    verdict = h.check()
    return {rule for rule, problems in verdict.violations.items() if problems}


def test_a_clean_history_passes_with_its_figures():
    verdict = clean().check()
    verdict.assert_ok()
    assert verdict.figures["appends sent"] == 5
    assert verdict.figures["acknowledged"] == 4
    assert verdict.figures["given up"] == "1 (0 of them stored anyway)"
    assert verdict.figures["duplicates"] == 0
    assert verdict.figures["violations"] == 0


def test_an_acknowledged_batch_missing_from_the_final_log_breaks_acked_readable():
    h = clean()
    h.record_final(1, [(0, 2, D[0]), (2, 2, D[1]), (4, 2, D[2])])  # offset 6 lost
    h.seen = [s for s in h.seen if s.offset < 6]
    assert broken(h) == {"acked-readable"}


def test_an_acknowledged_offset_holding_other_bytes_breaks_acked_readable():
    h = clean()
    h.record_sent("w2:5", "w2", 1, D[5])
    h.record_failed("w2:5", "ReadTimeoutError")
    # offset 6 holds w2:5 in the end, not w2:3 that was acknowledged there (nobody read it)
    h.record_final(1, [(0, 2, D[0]), (2, 2, D[1]), (4, 2, D[2]), (6, 2, D[5])])
    h.seen = [s for s in h.seen if s.offset < 6]
    assert broken(h) == {"acked-readable"}


def test_two_readers_seeing_different_bytes_at_one_offset_breaks_readers_agree():
    h = clean()
    h.record_seen("tail-2", 1, 0, 2, D[0], "198.18.0.11:1")
    h.record_seen("tail-2", 1, 2, 2, D[5], "198.18.0.11:1")  # not what the others saw
    h.record_sent("w2:5", "w2", 1, D[5])
    h.record_failed("w2:5", "ReplicationFailedError")
    assert broken(h) == {"readers-agree"}
    problems = h.check().violations["readers-agree"]
    assert "tail-2 from 198.18.0.11:1" in problems[0] and "offset 2" in problems[0]


def test_an_offset_that_un_appears_breaks_prefix():
    h = clean()
    h.record_sent("w1:5", "w1", 1, D[5])
    h.record_failed("w1:5", "ReplicationFailedError")
    h.record_seen("tail", 1, 8, 2, D[5], "198.18.0.12:1")  # seen, then sealed away
    assert broken(h) == {"prefix"}
    assert "offset 8" in h.check().violations["prefix"][0]


def test_a_reader_that_skipped_offsets_breaks_prefix():
    h = clean()
    h.record_seen("tail-2", 1, 0, 2, D[0])
    h.record_seen("tail-2", 1, 4, 2, D[2])  # never saw [2, 4)
    assert broken(h) == {"prefix"}
    assert "skipped stream 1 offsets [2, 4)" in h.check().violations["prefix"][0]


@pytest.mark.parametrize("last, kind", [(9, "hole"), (5, "overlap")])
def test_a_hole_or_an_overlap_in_the_final_log_breaks_no_holes(last, kind):
    h = clean()
    h.acked.pop("w2:3")  # its batch stands at ``last`` instead of 6 (nobody read there)
    h.seen = [s for s in h.seen if s.offset < 6]
    h.record_final(1, [(0, 2, D[0]), (2, 2, D[1]), (4, 2, D[2]), (last, 2, D[3])])
    assert broken(h) == {"no-holes"}
    assert f"{kind} at offset 6" in h.check().violations["no-holes"][0]


def test_a_batch_nobody_sent_breaks_no_phantoms():
    h = clean()
    h.record_final(1, [*((2 * i, 2, D[i]) for i in range(4)), (8, 1, digest(b"foreign"))])
    assert broken(h) == {"no-phantoms"}


def test_a_batch_stored_twice_is_counted_and_breaks_no_duplicates_only_when_idempotent():
    h = clean()
    # w1:4 was given up, yet it landed twice (its answers were lost, it was sent again)
    h.record_final(1, [*((2 * i, 2, D[i]) for i in range(4)), (8, 2, D[4]), (10, 2, D[4])])
    verdict = h.check()
    verdict.assert_ok()
    assert verdict.figures["duplicates"] == 1
    assert verdict.figures["given up"] == "1 (1 of them stored anyway)"
    h.mark_idempotent("w1")
    assert broken(h) == {"no-duplicates"}


def test_recording_mistakes_are_refused():
    h = History()
    h.record_sent("w1:0", "w1", 1, D[0])
    with pytest.raises(ValueError, match="twice"):
        h.record_sent("w1:0", "w1", 1, D[0])
    with pytest.raises(ValueError, match="never recorded"):
        h.record_acked("w9:0", 0)
    with pytest.raises(ValueError, match="kept for the final log"):
        h.record_seen(FINAL, 1, 0, 1, D[0])


def test_leadership_handed_over_without_overlap_passes():
    # pd-0 leads, goes quiet (cut off), pd-1 takes over; pd-0 leads again later, after pd-1.
    claims = [("pd-0", t / 10) for t in range(0, 30)] + \
        [("pd-1", 3.5 + t / 10) for t in range(0, 20)] + [("pd-0", 9.0), ("pd-0", 9.1)]
    assert leader_overlaps(claims, gap_s=0.5) == []
    assert [t[0] for t in leader_tenures(claims, gap_s=0.5)] == ["pd-0", "pd-1", "pd-0"]


def test_two_nodes_claiming_to_lead_at_once_is_an_overlap():
    claims = [("pd-0", t / 10) for t in range(0, 30)] + [("pd-1", 2.5), ("pd-1", 2.6)]
    [problem] = leader_overlaps(claims, gap_s=0.5)
    assert "pd-0 claimed to lead from 0.000 to 2.900 and pd-1 from 2.500 to 2.600" == problem
