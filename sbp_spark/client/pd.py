"""Client of the placement driver (PD): stream and range metadata, ids, heartbeats, metrics.

Every call goes to the PD leader. A follower answers PD_NOT_LEADER with the cluster's membership
in the status detail; the client switches to the leader it names and sends again. Unreachable
PD addresses are skipped in turn. Batch calls return one ``ItemResult`` per item, so one bad
item does not hide the others.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sbp_spark.protocol.constants import opcode_name
from sbp_spark.protocol.errors import (
    ConnectError,
    ErrorCode,
    HeaderError,
    PdNotLeaderError,
    PdUnreachableError,
    ReadTimeoutError,
    SbpError,
)
from sbp_spark.protocol.messages import (
    AllocateIdRequest,
    CreateRangeRequest,
    CreateStreamsRequest,
    DeleteStreamsRequest,
    DescribePdClusterRequest,
    DescribePermissionsRequest,
    DescribeRangesRequest,
    DescribeStreamsRequest,
    GrantPermissionsRequest,
    HeartbeatRequest,
    HeartbeatResponse,
    ListRangesRequest,
    Permission,
    PlacementDriverCluster,
    PlacementDriverNode,
    Range,
    RangeId,
    RangeOwner,
    RangeServer,
    RangeServerState,
    ReportMetricsRequest,
    ReportMetricsResponse,
    RevokePermissionsRequest,
    SealRangesRequest,
    Stream,
    TrimmedStream,
    TrimStreamsRequest,
    TrimStreamsResult,
    UpdateStreamsRequest,
)

from ._calls import checked_call, item_results
from .config import ClientConfig
from .connection import Connection, parse_address
from .heartbeat import Heartbeat
from .pool import ConnectionPool, get_pool
from .range_server import _range_id
from .retry import Retrier
from .types import ItemResult

# How long one call waits for a PD cluster to have a leader it can reach, from the first node
# that answered PD_NOT_LEADER: a dead leader's lease (3 s by default) must run out before
# another node can win, and the fault suite saw a new leader serve 2.4-3.5 s after a kill.
# These failures do not count against ClientConfig.retries when that caps the retries; the
# call's deadline still ends the wait.
PD_ELECTION_WAIT_S = 10.0
# The longest wait between two tries while the PD cluster elects a leader (the call's
# backoff grows to ``retry_backoff_max_ms``, 2 s, otherwise): the nemesis saw writers go on
# up to 2 s after the new leader served, their streams stalled meanwhile. A try then costs a
# PD node one PD_NOT_LEADER answer (or a refused connection) at most four times a second per
# waiting call; Kafka's clients refresh metadata every 100 ms (retry.backoff.ms) as leaders
# change.
PD_ELECTION_BACKOFF_MAX_MS = 250
# A PD node whose process is stopped or hung still accepts connections (the kernel completes
# the handshake) and takes requests, but answers nothing: without a check every call sent to
# it would wait the whole request timeout (30 s) before trying another node. A node's network
# core answers PING at once even while the node carries out a long request (a seal), so a
# node is PINGed before a request goes out on a connection that has heard nothing yet (or,
# for a request not sent again, nothing for this long), and when an answer is this late
# (see ``PdClient.call``).
PD_PROBE_S = 1.0


def parse_pd_addresses(pd_addresses: str | Sequence[str]) -> list[str]:
    """``"h1:p1,h2:p2"`` or a list of ``host:port`` strings, checked, without duplicates."""
    if isinstance(pd_addresses, str):
        items = [a.strip() for a in pd_addresses.split(",")]
    else:
        items = [str(a).strip() for a in pd_addresses]
    addresses: list[str] = []
    for item in items:
        if not item:
            continue
        parse_address(item)
        if item not in addresses:
            addresses.append(item)
    if not addresses:
        raise ValueError(f"PD addresses {pd_addresses!r}: give at least one host:port")
    return addresses


class PdClient:
    """Calls the PD cluster at ``pd_addresses`` (one or more ``host:port``).

    ``wait_for_election=False`` leaves a call that meets a cluster electing a leader to the
    retry policy alone (for callers that would rather fail and try again later)."""

    def __init__(self, pd_addresses: str | Sequence[str], config: ClientConfig | None = None,
                 pool: ConnectionPool | None = None, wait_for_election: bool = True) -> None:
        self.addresses = parse_pd_addresses(pd_addresses)
        self.wait_for_election = wait_for_election
        self.config = config if config is not None else ClientConfig()
        self.pool = pool if pool is not None else get_pool()
        self._lock = threading.Lock()
        self._leader: str | None = None
        self._next = 0  # which configured address to try when the leader is unknown
        self._answered = False  # some PD node answered a call of this client

    def __repr__(self) -> str:
        return f"PdClient({','.join(self.addresses)!r}, leader={self._leader!r})"

    @property
    def leader(self) -> str:
        """The address calls go to now (the known leader, else the next address to try)."""
        with self._lock:
            return self._leader or self.addresses[self._next % len(self.addresses)]

    # -- the call path ---------------------------------------------------------------------

    def call(self, msg: Any, deadline: float | None = None, resend: bool = True) -> Any:
        """Send ``msg`` to the leader (following redirects, retrying within the config's
        policy) and return the response; a failed top-level status raises ``ServerError``.
        While the PD cluster elects a new leader (a node answered PD_NOT_LEADER and none
        serves yet), the call waits for it up to ``PD_ELECTION_WAIT_S`` without using up
        the policy's retries.
        ``deadline`` (a ``time.monotonic()`` value) ends the retries sooner than the config's
        ``retry_deadline_s``: a caller inside its own retry loop passes its deadline.

        ``resend=False`` is for requests that must not be carried out twice: once the request
        was sent, a lost answer (the connection failed, or no answer came in time) is raised,
        no longer retriable, instead of sending the request again.

        A node that does not answer a PING within ``PD_PROBE_S`` (its process is stopped or
        hung) is passed over for the next one: before the request is sent to it on a new
        connection (with ``resend=False``: on one quiet for ``PD_PROBE_S``), and while its
        answer is late (only requests that may be sent again: others wait for their answer,
        which may be a refusal that proves they were not carried out)."""
        return self._call(msg, deadline, resend)[0]

    def _call(self, msg: Any, deadline: float | None = None, resend: bool = True,
              check: Callable[[Any, str], None] | None = None) -> tuple[Any, bool]:
        """``call``, and whether the response answers a resend: an earlier attempt sent
        ``msg`` and its answer was lost, so the PD may have carried that one out already.
        ``check(response, address)`` may refuse an answer by raising, as if the node had."""
        call = _PdCall(self, msg, resend, check)
        retrier = Retrier(self.config, on_error=self._on_error, deadline=deadline,
                          spare=call.electing if self.wait_for_election else None,
                          spare_backoff_max_ms=PD_ELECTION_BACKOFF_MAX_MS)
        try:
            answer = retrier.run(call.attempt)
        except (ConnectError, PdNotLeaderError) as exc:
            error = call.explained(exc, retrier)
            if error is exc:
                raise
            raise error from exc
        self._answered = True
        return answer, call.lost

    def _on_error(self, error: SbpError) -> bool:
        if isinstance(error, PdNotLeaderError):
            named = _leader_of(error.detail)
            leader = named.advertise_addr if named is not None else None
            with self._lock:
                if leader is not None and leader != self._leader:
                    self._leader = leader
                    return True  # a redirect: send again at once
                self._forget_leader()
            return False
        if error.invalid_metadata:  # unreachable, or no longer the leader's to answer
            with self._lock:
                self._forget_leader()
        return False

    def _forget_leader(self) -> None:
        # Move on to the next configured address, so a dead PD is not asked again at once.
        if self._leader is not None and self._leader in self.addresses:
            self._next = self.addresses.index(self._leader) + 1
        elif self._leader is None:
            self._next += 1
        self._leader = None

    # -- streams ---------------------------------------------------------------------------

    def create_streams(self, streams: Sequence[Stream]) -> list[ItemResult[Stream]]:
        """Create streams: a stream_id of -1 lets the PD choose one; an id >= 0 asks for
        that id, which the PD refuses (STREAM_ALREADY_EXISTS) when it is taken.

        Never sent twice: a create whose answer was lost raises (not retriable), since the
        streams may exist already and a second create would make them again: list the
        streams to find out."""
        response = self.call(CreateStreamsRequest(self.config.server_timeout_ms, list(streams)),
                             resend=False)
        return item_results(response.create_responses, len(streams), lambda a: a.stream,
                            "CREATE_STREAMS")

    def delete_streams(self, stream_ids: Sequence[int]) -> list[ItemResult[Stream]]:
        """Delete streams; each result is the deleted stream.

        A delete whose answer was lost is sent again, and the PD has usually carried out the
        first one: the resend's STREAM_NOT_FOUND (the stream was deleted, or is not there)
        means the stream is gone as asked, so that item succeeds, with a value naming only
        the stream's id (``deleted`` set). A first attempt that finds a stream gone fails."""
        request = DeleteStreamsRequest(self.config.server_timeout_ms,
                                       [Stream(stream_id=int(s)) for s in stream_ids])
        response, resent = self._call(request)
        results = item_results(response.delete_responses, len(stream_ids),
                               lambda a: a.deleted_stream, "DELETE_STREAMS")
        if resent:
            results = [ItemResult(Stream(stream_id=int(s), deleted=True))
                       if r.status.code == ErrorCode.STREAM_NOT_FOUND else r
                       for s, r in zip(stream_ids, results, strict=True)]
        return results

    def update_streams(self, streams: Sequence[Stream]) -> list[ItemResult[Stream]]:
        """Change replica counts or retention; each result is the updated stream."""
        response = self.call(UpdateStreamsRequest(self.config.server_timeout_ms, list(streams)))
        return item_results(response.update_responses, len(streams),
                            lambda a: a.updated_stream, "UPDATE_STREAMS")

    def describe_streams(self, stream_ids: Sequence[int], names: Sequence[str] = ()
                         ) -> list[ItemResult[Stream]]:
        """The current metadata of streams: those of ``stream_ids``, then those of ``names``
        (live streams looked up by name; STREAM_NOT_FOUND for a name none has)."""
        ids = [int(s) for s in stream_ids]
        by_name = [Stream(name=n) for n in names]
        response = self.call(DescribeStreamsRequest(self.config.server_timeout_ms, ids,
                                                    by_name))
        return item_results(response.describe_responses, len(ids) + len(by_name),
                            lambda a: a.stream, "DESCRIBE_STREAMS")

    def list_streams(self) -> list[Stream]:
        """Every stream that is not deleted, in id order (DESCRIBE_STREAMS naming no stream,
        which this project's PD answers with all of them)."""
        response = self.call(DescribeStreamsRequest(self.config.server_timeout_ms, []))
        return [a.stream for a in response.describe_responses
                if a.status.code == 0 and a.stream is not None]

    def trim_streams(self, trims: Sequence[tuple[int, int]]
                     ) -> list[ItemResult[TrimStreamsResult]]:
        """Drop records below a trim offset: ``[(stream_id, trim_offset), ...]``. Each value
        carries the trimmed stream and its first range after the trim."""
        items = [TrimmedStream(int(s), int(o)) for s, o in trims]
        response = self.call(TrimStreamsRequest(self.config.server_timeout_ms, items))
        return item_results(response.streams, len(items), lambda a: a, "TRIM_STREAMS")

    # -- ranges ----------------------------------------------------------------------------

    def list_ranges(self, stream_ids: Sequence[int], deadline: float | None = None
                    ) -> list[ItemResult[list[Range]]]:
        """The ranges of each stream, in range_index order (``deadline``: see ``call``)."""
        owners = [RangeOwner(stream_id=int(s)) for s in stream_ids]
        response = self.call(ListRangesRequest(self.config.server_timeout_ms, owners), deadline)
        return item_results(response.list_responses, len(owners),
                            lambda a: sorted(a.ranges, key=lambda r: r.range_index),
                            "LIST_RANGES")

    def list_ranges_by_server(self, servers: Sequence[RangeServer]
                              ) -> list[ItemResult[list[Range]]]:
        """The ranges each range server holds."""
        owners = [RangeOwner(range_server=s) for s in servers]
        response = self.call(ListRangesRequest(self.config.server_timeout_ms, owners))
        return item_results(response.list_responses, len(owners), lambda a: list(a.ranges),
                            "LIST_RANGES")

    def describe_ranges(self, ranges: Sequence[RangeId | Range | tuple[int, int]],
                        deadline: float | None = None) -> list[ItemResult[Range]]:
        """The PD's view of ranges (replicas with the addresses they last announced).
        ``deadline``: as in ``call``."""
        ids = [_range_id(r) for r in ranges]
        response = self.call(DescribeRangesRequest(self.config.server_timeout_ms, ids),
                             deadline=deadline)
        return item_results(response.describe_responses, len(ids), lambda a: a.range,
                            "DESCRIBE_RANGES")

    def seal_ranges(self, ranges: Sequence[RangeId | Range | tuple[int, int]],
                    deadline: float | None = None, timeout_ms: int | None = None
                    ) -> list[ItemResult[Range]]:
        """Seal each stream's open range and open the next; each value is the new open
        range. ``deadline``: as in ``call``. ``timeout_ms``: the bound of the PD's calls to
        the range's replicas (default ``server_timeout_ms``)."""
        ids = [_range_id(r) for r in ranges]
        bound = self.config.server_timeout_ms if timeout_ms is None else timeout_ms
        response = self.call(SealRangesRequest(bound, ids), deadline)
        return item_results(response.seal_responses, len(ids), lambda a: a.range,
                            "SEAL_RANGES")

    def create_range(self, ranges: Sequence[RangeId | tuple[int, int]],
                     deadline: float | None = None) -> list[ItemResult[Range]]:
        """Open range ``range_index`` of each stream (its last range must be sealed).
        ``deadline``: as in ``call``."""
        ids = [_range_id(r) for r in ranges]
        response = self.call(CreateRangeRequest(self.config.server_timeout_ms, ids), deadline)
        return item_results(response.create_responses, len(ids), lambda a: a.range,
                            "CREATE_RANGE")

    # -- cluster ---------------------------------------------------------------------------

    def allocate_id(self, host: str = "") -> int:
        """A new unique id from the PD (a range server's server_id)."""
        response = self.call(AllocateIdRequest(self.config.server_timeout_ms, host))
        return response.id

    def describe_pd_cluster(self, range_server: RangeServer | None = None
                            ) -> PlacementDriverCluster:
        """The PD members and which one leads."""
        response = self.call(
            DescribePdClusterRequest(range_server, self.config.server_timeout_ms))
        return response.cluster if response.cluster is not None else PlacementDriverCluster()

    def range_servers(self, deadline: float | None = None) -> list[RangeServerState]:
        """Every range server the PD knows: address, liveness, open ranges, last metrics.

        Any PD node answers DESCRIBE_PD_CLUSTER, but only the leader knows the range servers:
        a follower's answer (which lists none) is refused like its PD_NOT_LEADER, and the
        call goes on to the leader it names, or waits for one to be elected. ``deadline``:
        as in ``call``."""
        request = DescribePdClusterRequest(None, self.config.server_timeout_ms)
        response, _ = self._call(request, deadline, check=_from_the_leader)
        return list(response.range_servers)

    def grant_permissions(self, permissions: Sequence[Permission]) -> int:
        """Grant ``permissions`` (superusers only); the version of the permissions after."""
        return int(self.call(GrantPermissionsRequest(list(permissions))).version)

    def revoke_permissions(self, permissions: Sequence[Permission]) -> int:
        """Revoke ``permissions`` (superusers only); the version of the permissions after."""
        return int(self.call(RevokePermissionsRequest(list(permissions))).version)

    def describe_permissions(self, principal: str = "") -> tuple[int, list[Permission]]:
        """The version of the permissions and those of ``principal`` ("": everyone's)."""
        response = self.call(DescribePermissionsRequest(principal))
        return int(response.version), list(response.permissions)

    def heartbeat(self, request: HeartbeatRequest) -> HeartbeatResponse:
        """Send one HEARTBEAT (a range server announcing itself, or an SDK client)."""
        return self.call(request)

    def report_metrics(self, request: ReportMetricsRequest) -> ReportMetricsResponse:
        """Send a range server's load figures."""
        return self.call(request)

    def start_heartbeat(
        self,
        make_request: Callable[[], HeartbeatRequest],
        interval_s: float,
        on_response: Callable[[HeartbeatResponse], None] | None = None,
    ) -> Heartbeat:
        """Send ``make_request()`` to the PD leader every ``interval_s`` seconds on a
        background thread (following leader changes) until the returned ``Heartbeat``
        is stopped."""

        def beat() -> None:
            response = self.heartbeat(make_request())
            if on_response is not None:
                on_response(response)

        return Heartbeat(beat, interval_s, name=f"sbp-pd-heartbeat-{self.addresses[0]}")


class _PdCall:
    """One ``PdClient`` call: its request, and what its attempts learned (a lost answer, since
    when the PD cluster has been between leaders, which leaders its nodes named)."""

    def __init__(self, pd: PdClient, msg: Any, resend: bool,
                 check: Callable[[Any, str], None] | None) -> None:
        self.pd = pd
        self.msg = msg
        self.resend = resend
        self.check = check
        self.lost = False  # an attempt sent the request and its answer was lost
        self.electing_since: float | None = None  # the first PD_NOT_LEADER of the call
        self.leaders = _NamedLeaders()
        self.probe_s = min(PD_PROBE_S, pd.config.request_timeout_s)

    def attempt(self) -> Any:
        """Send the request to the node that leads as far as the client knows."""
        target = self.pd.leader
        with self.leaders.asking(target):
            conn = self.pd.pool.get(target, self.pd.config)
            if conn.last_heard == 0.0 or (
                    not self.resend and time.monotonic() - conn.last_heard > self.probe_s):
                _check_answers(conn, self.msg, self.probe_s)
            if self.resend:
                response = checked_call(conn, self.msg, on_lost=self._note_lost,
                                        probe_s=self.probe_s)
            else:
                response = checked_call(conn, self.msg, on_lost=lambda exc: _outcome_unknown(
                    exc, self.msg, conn.address))
        if self.check is not None:
            self.check(response, conn.address)
        return response

    def _note_lost(self, exc: SbpError) -> SbpError:
        self.lost = True
        return exc

    def electing(self, error: SbpError) -> bool:
        """A ``Retrier`` spare: a node answered but cannot serve, so the cluster is between
        leaders. Until a leader answers, the old one refusing connections is part of the same
        wait (up to ``PD_ELECTION_WAIT_S``)."""
        now = time.monotonic()
        if isinstance(error, PdNotLeaderError) and self.electing_since is None:
            self.electing_since = now
        return (self.electing_since is not None and error.invalid_metadata
                and now < self.electing_since + PD_ELECTION_WAIT_S)

    def explained(self, exc: ConnectError | PdNotLeaderError, retrier: Retrier) -> SbpError:
        """The error the call ends with: ``exc``, or one that says what the attempts saw (a
        PD never reached, a leader named but unreachable, no leader for so long)."""
        if isinstance(exc, ConnectError):
            if self.pd._answered or isinstance(exc, PdUnreachableError):
                return exc
            if why := self.leaders.unreachable(self.electing_since):
                return ConnectError(why)
            # Never reached: most often a wrong address (the Spark option 'pd', say).
            return PdUnreachableError(
                f"no PD answered at {', '.join(self.pd.addresses)} (is a PD running there, and "
                f"is that the address you meant?): {exc}")
        if self.electing_since is None:
            return exc
        # The last refusal alone names one node's view, often a leader that is gone.
        waited = time.monotonic() - self.electing_since
        if why := self.leaders.unreachable(self.electing_since):
            return PdNotLeaderError(why, detail=exc.detail)
        last = retrier.stopped[0] if retrier.stopped is not None else exc
        answer = last.message if isinstance(last, PdNotLeaderError) else str(last)
        return PdNotLeaderError(
            f"no PD node served as leader for {waited:.1f} s (asked "
            f"{', '.join(self.pd.addresses)}; no node can lead while the nodes cannot reach "
            f"etcd); the last answer: {answer}", detail=exc.detail)


def _check_answers(conn: Connection, msg: Any, probe_s: float) -> None:
    """Raise ``ReadTimeoutError`` (retriable: the next node is tried) when the PD node at
    the other end of ``conn`` does not answer a PING within ``probe_s``: ``msg`` is then
    not sent to it."""
    try:
        conn.ping(timeout=probe_s)
    except ReadTimeoutError as exc:
        raise ReadTimeoutError(
            f"the PD node at {conn.address} accepts connections but did not answer a PING "
            f"within {probe_s:g}s (its process is stopped or hung): "
            f"{opcode_name(msg.OPCODE)} was not sent to it") from exc


def _outcome_unknown(error: SbpError, msg: Any, address: str) -> SbpError:
    """``error``, a failure after ``msg`` was sent, as a final one saying that the PD may
    have carried the request out (unchanged when it would not be retried anyway)."""
    if not error.retriable:
        return error
    fresh = type(error)(f"{opcode_name(msg.OPCODE)} to {address} got no answer ({error}); "
                        f"the PD may have carried it out, so it was not sent again")
    fresh.retriable = False
    return fresh


def _from_the_leader(response: Any, address: str) -> None:
    """Raise PD_NOT_LEADER unless the DESCRIBE_PD_CLUSTER answer from ``address`` says that
    node leads (a PD that lists no members is taken at its word)."""
    cluster = response.cluster
    if cluster is None or not cluster.members:
        return
    leader = cluster.leader
    if leader is not None and leader.advertise_addr in ("", address):
        return
    where = (f"it names {leader.name} at {leader.advertise_addr}" if leader is not None
             else "no leader is elected right now")
    raise PdNotLeaderError(f"the PD node at {address} is not the leader and does not know "
                           f"the range servers: {where}", detail=cluster.to_flatbuffers())


class _NamedLeaders:
    """The leaders PD nodes named in PD_NOT_LEADER during one call, and which of them this
    client could not connect to: a node that keeps naming a leader whose advertised address
    does not work from here (a container's name seen from the host, say) is not a cluster
    without a leader, and the error says so."""

    def __init__(self) -> None:
        self._named: dict[str, tuple[str, str]] = {}  # address: (leader's name, named by)
        self._unreachable: dict[str, str] = {}  # address: the connection error

    @contextlib.contextmanager
    def asking(self, node: str) -> Iterator[None]:
        """Notes what asking ``node`` (inside the block) said about the leader."""
        try:
            yield
        except PdNotLeaderError as exc:
            self._unreachable.pop(node, None)  # it answered: reachable after all
            leader = _leader_of(exc.detail)
            if leader is not None:
                self._named[leader.advertise_addr] = (leader.name, node)
            raise
        except ConnectError as exc:
            if node in self._named:
                self._unreachable[node] = str(exc)
            raise

    def unreachable(self, since: float | None) -> str | None:
        """What to tell the user when the last leader named, waited for from ``since`` (a
        ``time.monotonic()`` value), could not be reached."""
        if not self._unreachable or since is None:
            return None
        waited = time.monotonic() - since
        address, error = next(reversed(self._unreachable.items()))
        name, by = self._named[address]
        return (f"the leader {name} at {address} (as the PD node at {by} names it) cannot be "
                f"reached from here: {error}; waited {waited:.1f} s for a leader this client "
                f"can reach. Unless that node is down, its advertised address is wrong for "
                f"this client: PD nodes hand out the address they advertise (--advertise-addr "
                f"or --advertise-host); run the client where that address resolves and is "
                f"reachable (with docker-compose.yml, in a container on its network), or "
                f"advertise addresses this client can reach")


def _leader_of(detail: bytes) -> PlacementDriverNode | None:
    """The leader a PD_NOT_LEADER answer's detail names, if it gives a usable address."""
    if not detail:
        return None
    try:
        cluster = PlacementDriverCluster.from_flatbuffers(detail)
    except HeaderError:
        return None
    leader = cluster.leader
    if leader is None or not leader.advertise_addr:
        return None
    try:
        parse_address(leader.advertise_addr)
    except ValueError:
        return None
    return leader
