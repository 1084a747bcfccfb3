"""A history of what clients did and saw, and the rules it must obey once the network healed.

Writers record every batch they send (its bytes' digest), then either its acknowledgement
(offset and range) or its failure (given up: it may or may not be stored). Readers record every
batch they saw: stream, offset, record count, digest and the replica that served it. After the
faults are healed, the final log of each stream (read end to end, and each sealed range from
each of its replicas) is recorded too, and ``check`` applies the rules:

``acked-readable``  every acknowledged batch is in the final log at its acknowledged offset,
                    byte for byte;
``readers-agree``   no two observations (readers, replicas, the final log) ever saw different
                    bytes at the same offset of the same stream;
``prefix``          every reader's view is a prefix of the final log: each batch it saw
                    begins there at the same offset with as many records, and it saw them
                    without gaps (nothing it saw "un-appears", and it skipped nothing);
``no-holes``        the final log's offsets run without a gap or an overlap from its start to
                    its end;
``no-phantoms``     every batch of the final log was sent by a writer;
``no-duplicates``   (streams written idempotently) no sent batch is stored twice. Elsewhere
                    duplicates (at-least-once retries) are only counted.

A ``History`` is thread-safe: driver output readers and test threads record into it at once.

With a PD cluster, a prober asks every PD node over and over whether it leads, and
``leader_overlaps`` checks the answers: no two nodes may ever claim to lead at once.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

FINAL = "final log"


def digest(body: bytes | memoryview) -> str:
    """The identity of a batch's bytes, as recorded."""
    return hashlib.blake2b(body, digest_size=16).hexdigest()


@dataclass(frozen=True)
class Sent:
    """One batch a writer sent."""

    op: str  # unique: "<writer>:<sequence>"
    writer: str
    stream: int
    digest: str


@dataclass(frozen=True)
class Seen:
    """One batch an observer saw (a reader, a replica read after healing, the final log)."""

    observer: str
    stream: int
    offset: int
    count: int
    digest: str
    server: str = ""


@dataclass
class Verdict:
    """What ``History.check`` found: broken rules (rule -> problems) and figures."""

    violations: dict[str, list[str]] = field(default_factory=dict)
    figures: dict[str, int | str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def summary(self) -> str:
        """One line of figures, then one per broken rule with its first problems."""
        lines = ["; ".join(f"{k}: {v}" for k, v in self.figures.items())]
        for rule, problems in self.violations.items():
            if problems:
                shown = "; ".join(problems[:5])
                lines.append(f"{rule}: {len(problems)} problem(s): {shown}")
        return "\n".join(lines)

    def assert_ok(self) -> None:
        assert self.ok, "the history breaks the rules:\n" + self.summary()


class History:
    """Every operation of a run (see the module doc); ``check`` judges it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent: dict[str, Sent] = {}
        self.acked: dict[str, tuple[int, int]] = {}  # op -> (offset, range index)
        self.failed: dict[str, str] = {}  # op -> the error it was given up with
        self.seen: list[Seen] = []
        self.final: dict[int, list[Seen]] = {}  # stream -> the final log, in offset order
        self.idempotent: set[str] = set()  # writers whose streams must hold no duplicate

    # -- recording ---------------------------------------------------------------------------

    def record_sent(self, op: str, writer: str, stream: int, body_digest: str) -> None:
        with self._lock:
            if op in self.sent:
                raise ValueError(f"operation {op} was recorded as sent twice")
            self.sent[op] = Sent(op, writer, stream, body_digest)

    def record_acked(self, op: str, offset: int, range_index: int = -1) -> None:
        with self._lock:
            self._known(op)
            self.acked[op] = (offset, range_index)

    def record_failed(self, op: str, error: str) -> None:
        with self._lock:
            self._known(op)
            self.failed[op] = error

    def record_seen(self, observer: str, stream: int, offset: int, count: int,
                    body_digest: str, server: str = "") -> None:
        if observer == FINAL:
            raise ValueError(f"observer name {FINAL!r} is kept for the final log")
        with self._lock:
            self.seen.append(Seen(observer, stream, offset, count, body_digest, server))

    def record_final(self, stream: int, batches: Iterable[tuple[int, int, str]]) -> None:
        """The stream's final log: (offset, record count, digest) of each batch, in order."""
        with self._lock:
            self.final[stream] = [Seen(FINAL, stream, o, c, d) for o, c, d in batches]

    def mark_idempotent(self, writer: str) -> None:
        """``writer`` writes idempotently: a batch of it stored twice breaks a rule."""
        with self._lock:
            self.idempotent.add(writer)

    def _known(self, op: str) -> None:
        if op not in self.sent:
            raise ValueError(f"operation {op} was never recorded as sent")

    # -- judging -----------------------------------------------------------------------------

    def check(self) -> Verdict:
        """Apply every rule (see the module doc) to what was recorded."""
        with self._lock:
            return _Judge(self).verdict()


class _Judge:
    def __init__(self, history: History) -> None:
        self.h = history
        self.v = Verdict(violations={rule: [] for rule in (
            "acked-readable", "readers-agree", "prefix", "no-holes", "no-phantoms",
            "no-duplicates")})
        # stream -> offset -> the final log's batch there
        self.at: dict[int, dict[int, Seen]] = {
            sid: {b.offset: b for b in log} for sid, log in history.final.items()}

    def problem(self, rule: str, text: str) -> None:
        self.v.violations[rule].append(text)

    def verdict(self) -> Verdict:
        self.acked_readable()
        self.readers_agree()
        self.prefixes()
        self.holes()
        stored = self.phantoms_and_duplicates()
        self.figures(stored)
        return self.v

    def acked_readable(self) -> None:
        for op, (offset, range_index) in sorted(self.h.acked.items()):
            sent = self.h.sent[op]
            final = self.at.get(sent.stream)
            if final is None:
                self.problem("acked-readable", f"{op}: stream {sent.stream} has no final log")
                continue
            found = final.get(offset)
            if found is None:
                self.problem("acked-readable", f"{op}: acknowledged at stream {sent.stream} "
                             f"offset {offset} (range {range_index}), no batch begins there")
            elif found.digest != sent.digest:
                self.problem("acked-readable", f"{op}: acknowledged at stream {sent.stream} "
                             f"offset {offset} (range {range_index}), other bytes are there")

    def readers_agree(self) -> None:
        by_place: dict[tuple[int, int], dict[str, list[Seen]]] = defaultdict(
            lambda: defaultdict(list))
        for seen in [*self.h.seen, *(b for log in self.h.final.values() for b in log)]:
            by_place[(seen.stream, seen.offset)][seen.digest].append(seen)
        for (stream, offset), versions in sorted(by_place.items()):
            if len(versions) > 1:
                who = "; ".join(
                    f"{d[:8]} seen by " + ", ".join(sorted({
                        s.observer + (f" from {s.server}" if s.server else "") for s in seen}))
                    for d, seen in versions.items())
                self.problem("readers-agree", f"stream {stream} offset {offset}: "
                             f"{len(versions)} different batches ({who})")

    def prefixes(self) -> None:
        views: dict[tuple[str, int], list[Seen]] = defaultdict(list)
        for seen in self.h.seen:
            views[(seen.observer, seen.stream)].append(seen)
        for (observer, stream), view in sorted(views.items(), key=lambda kv: kv[0]):
            final = self.at.get(stream, {})
            expected: int | None = None
            for seen in sorted(view, key=lambda s: s.offset):
                # Other bytes at the same place break readers-agree; here: is it there at all.
                there = final.get(seen.offset)
                if there is None or there.count != seen.count:
                    what = ("nothing begins there" if there is None else
                            f"the batch there holds {there.count} records, not {seen.count}")
                    self.problem("prefix", f"{observer} saw stream {stream} offset "
                                 f"{seen.offset} (from {seen.server or '?'}), but in the final "
                                 f"log {what}")
                if expected is not None and seen.offset > expected:
                    self.problem("prefix", f"{observer} skipped stream {stream} offsets "
                                 f"[{expected}, {seen.offset})")
                end = seen.offset + seen.count
                expected = end if expected is None else max(expected, end)

    def holes(self) -> None:
        for stream, log in sorted(self.h.final.items()):
            expected: int | None = None
            for b in log:
                if expected is not None and b.offset != expected:
                    kind = "hole" if b.offset > expected else "overlap"
                    self.problem("no-holes", f"stream {stream}: {kind} at offset {expected} "
                                 f"(next batch at {b.offset})")
                expected = b.offset + b.count

    def phantoms_and_duplicates(self) -> Counter:
        sent_by_digest = {s.digest: s for s in self.h.sent.values()}
        stored: Counter = Counter()
        for stream, log in sorted(self.h.final.items()):
            for b in log:
                sent = sent_by_digest.get(b.digest)
                if sent is None or sent.stream != stream:
                    self.problem("no-phantoms", f"stream {stream} offset {b.offset}: a batch "
                                 "no writer sent to this stream")
                    continue
                stored[sent.op] += 1
        for op, times in sorted(stored.items()):
            sent = self.h.sent[op]
            if times > 1 and sent.writer in self.h.idempotent:
                self.problem("no-duplicates", f"{op} (idempotent writer {sent.writer}) is "
                             f"stored {times} times in stream {sent.stream}")
        return stored

    def figures(self, stored: Counter) -> None:
        h, f = self.h, self.v.figures
        failed_stored = sum(1 for op in h.failed if stored.get(op))
        f["appends sent"] = len(h.sent)
        f["acknowledged"] = len(h.acked)
        f["given up"] = f"{len(h.failed)} ({failed_stored} of them stored anyway)"
        f["never answered"] = len(set(h.sent) - set(h.acked) - set(h.failed))
        f["reads"] = f"{len(h.seen)} batches by {len({s.observer for s in h.seen})} observers"
        f["final log"] = ", ".join(f"stream {sid}: {len(log)} batches"
                                   for sid, log in sorted(h.final.items())) or "none"
        f["duplicates"] = sum(times - 1 for times in stored.values() if times > 1)
        f["violations"] = sum(len(p) for p in self.v.violations.values())


def leader_tenures(claims: Iterable[tuple[str, float]], gap_s: float
                   ) -> list[tuple[str, float, float]]:
    """(node, first, last claim) of each stretch in which a node kept claiming to lead: its
    claims (node, time) with no gap longer than ``gap_s`` (longer than the prober's round)."""
    by_node: dict[str, list[float]] = defaultdict(list)
    for node, at in claims:
        by_node[node].append(at)
    tenures = []
    for node, times in sorted(by_node.items()):
        times.sort()
        start = last = times[0]
        for at in times[1:]:
            if at - last > gap_s:
                tenures.append((node, start, last))
                start = at
            last = at
        tenures.append((node, start, last))
    return sorted(tenures, key=lambda t: t[1])


def leader_overlaps(claims: Iterable[tuple[str, float]], gap_s: float) -> list[str]:
    """Where two PD nodes claimed to lead at the same time: each pair of overlapping
    tenures (``leader_tenures``), said in words; empty when leadership never overlapped."""
    tenures = leader_tenures(claims, gap_s)
    out = []
    for i, (node_a, start_a, end_a) in enumerate(tenures):
        for node_b, start_b, end_b in tenures[i + 1:]:
            if node_b != node_a and start_b <= end_a and start_a <= end_b:
                out.append(f"{node_a} claimed to lead from {start_a:.3f} to {end_a:.3f} and "
                           f"{node_b} from {start_b:.3f} to {end_b:.3f}")
    return out
