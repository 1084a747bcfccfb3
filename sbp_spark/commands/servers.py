"""``sbp server``, ``sbp pd`` and ``sbp range-server``: the cluster's servers in the foreground.

Each runs until SIGINT or SIGTERM, then stops gracefully: GOAWAY to every peer, in-flight
requests finish, files are closed. ``--ready-file`` makes them write a JSON file with their
addresses once every role accepts connections, for scripts and tests. Bad arguments raise
``ValueError``, which ``sbp_spark.cli`` turns into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

from sbp_spark.server.pd.etcd_store import DEFAULT_PREFIX as DEFAULT_ETCD_PREFIX
from sbp_spark.server.storage import DEFAULT_PAGE_CACHE_BYTES

from .common import DEFAULT_PD_PORT, PD_ENV, address_arg, int_in, pd_addresses_arg

# The `sbp` command's logger: the servers' lines are the command's own.
log = logging.getLogger("sbp_spark.cli")

FSYNC_CHOICES = ("group", "always", "interval", "never")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp server``, ``sbp pd`` and ``sbp range-server``."""
    _add_server(subparsers)
    _add_pd(subparsers)
    _add_range_server(subparsers)


# -- argument types and groups ------------------------------------------------------------------


def _data_dir(path: str) -> Path:
    if not path.strip():
        # Path("") is the working directory: `--data-dir "$UNSET"` would put data there.
        raise ValueError("--data-dir is empty: name the directory to keep the data in")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--data-dir {path}: exists and is not a directory")
    return p


def _check_range_server_count(data_dir: Path, count: int) -> None:
    """Refuse ``--range-servers`` below the range servers ``data_dir`` holds data of: the
    ones left out would not run, and the streams they hold could not be read or written."""
    from sbp_spark.server.range_server.identity import SERVER_FILE

    indexes = (int(d.name[3:]) for d in data_dir.glob("rs-*")
               if d.name[3:].isdigit() and (d / SERVER_FILE).exists())
    left_out = sorted(i for i in indexes if i >= count)
    if left_out:
        names = ", ".join(f"rs-{i}" for i in left_out)
        raise ValueError(
            f"--data-dir {data_dir} holds the data of range servers {names}, which "
            f"--range-servers {count} would not start (their streams could not be read or "
            f"written): give --range-servers {left_out[-1] + 1}, or move those directories "
            "away if their data is to be dropped")


def _add_listen_args(parser: argparse.ArgumentParser, what: str, port: int = 0) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"address to listen on for the {what} (default 127.0.0.1)")
    default = f"{port}" if port else "0: any free port"
    parser.add_argument("--port", type=int_in(0, 65535), default=port,
                        help=f"port of the {what} (default {default})")


def _add_advertise_args(parser: argparse.ArgumentParser, whole_address: bool = True) -> None:
    """What the server tells clients to connect to, when not the listening address (needed
    when listening on every interface, --host 0.0.0.0)."""
    group = parser.add_mutually_exclusive_group()
    if whole_address:
        group.add_argument("--advertise-addr", type=address_arg, metavar="HOST:PORT",
                           help="address clients should use, if not the listening one (a "
                                "port mapped elsewhere, as in containers)")
    group.add_argument("--advertise-host", metavar="HOST",
                       help="host name or IP clients should use with the listening port(s), "
                            "if not the listening host; required with --host 0.0.0.0")


def _add_fsync_arg(parser: argparse.ArgumentParser) -> None:
    from sbp_spark.server.storage import DEFAULT_FSYNC_INTERVAL_MS, POLICY_HELP

    policies = "; ".join(f"{policy.value}: {text}" for policy, text in POLICY_HELP.items())
    parser.add_argument("--fsync", choices=FSYNC_CHOICES, default="group",
                        help="when range servers make appends durable (fsync); every policy "
                             "but never acknowledges an append only once it is on disk. "
                             f"{policies} (default group)")
    parser.add_argument("--fsync-interval-ms", type=int_in(1), metavar="MS",
                        default=DEFAULT_FSYNC_INTERVAL_MS,
                        help="the fsync interval: under group, the longest a write waits for "
                             "its flush while a burst is stored; under interval, the flush "
                             f"period (default {DEFAULT_FSYNC_INTERVAL_MS})")


def _add_page_cache_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--page-cache-mib", type=int_in(0), metavar="MIB",
                        default=DEFAULT_PAGE_CACHE_BYTES >> 20,
                        help="how much freshly written data range servers leave in the OS page "
                             "cache; older data is dropped from it once on disk, so its pages "
                             f"are reused (default {DEFAULT_PAGE_CACHE_BYTES >> 20}; 0: no "
                             "bound)")


def _ready_file(path: str) -> Path:
    # Checked up front: the file is written only once the servers run (a range server: once
    # the PD registered it), too late to learn that it cannot be.
    p = Path(path)
    if not p.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: directory {p.parent} does not exist")
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory")
    return p


@contextlib.contextmanager
def _ready_file_writer(path: Path | None) -> Iterator[Callable[[dict], None]]:
    """A function writing the ready file (none without ``--ready-file``); the file written is
    removed when the servers stop, so a script never takes a stopped server for a serving
    one. (One left by a crash stays: whoever waits for the file removes it first, as
    ``ServerProcess`` does; a server refused at start must not remove a running one's.)"""
    from sbp_spark.server.cluster import write_ready_file

    written = False

    def write(info: dict) -> None:
        nonlocal written
        if path is not None:
            write_ready_file(path, info)
            written = True

    try:
        yield write
    finally:
        if written and path is not None:
            path.unlink(missing_ok=True)


def _add_metrics_arg(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--metrics-port", type=int_in(0, 65535), default=None, metavar="PORT",
                        help=f"serve Prometheus metrics at http://HOST:PORT/metrics ({what}; "
                             "0: a free port, which the ready file names); default: none")


def _add_ready_file_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ready-file", metavar="FILE", type=_ready_file,
                        help="write the listening addresses to FILE as JSON once serving "
                             "(removed again when the servers stop)")


def _add_tls_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "TLS", "serve TLS on every port; with --tls-ca, peers must present a certificate "
               "signed by that CA (mutual TLS), and the servers call each other with theirs")
    group.add_argument("--tls-cert", metavar="FILE", help="this server's certificate (PEM)")
    group.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (PEM)")
    group.add_argument("--tls-ca", metavar="FILE",
                       help="CA certificates that peers' certificates must chain to (PEM)")


def _tls_of(args: argparse.Namespace):
    """The server TLS settings of the command line (None without --tls-cert/--tls-key)."""
    from sbp_spark.transport.tls import TlsConfig, unusable_file

    if args.tls_cert is None and args.tls_key is None:
        if args.tls_ca is not None:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key (a server's own "
                             "certificate)")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    tls = TlsConfig(cert_file=args.tls_cert, key_file=args.tls_key, ca_file=args.tls_ca)
    # Checked before anything starts, in the command line's terms (the servers' own check
    # speaks of the client configuration they call each other with).
    unusable = unusable_file(tls)
    if unusable:
        raise ValueError(f"TLS files cannot be used: {unusable}")
    return tls


def _add_auth_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "authentication", "who may connect, and as whom (none of these: the cluster is open "
                          "to anyone who reaches its ports); with --tls-ca, a client "
                          "certificate authenticates its connection too")
    keys = group.add_mutually_exclusive_group()
    keys.add_argument("--auth-token-secret", metavar="FILE",
                      help="accept tokens signed with this shared secret (HS256)")
    keys.add_argument("--auth-token-public-key", metavar="FILE",
                      help="accept tokens signed with the private key of this public key "
                           "(RS256, PEM)")
    group.add_argument("--superusers", metavar="NAME[,NAME...]", type=_superusers_arg,
                       default=frozenset(),
                       help="principals that may do everything, permissions included")
    group.add_argument("--server-token", metavar="FILE",
                       help="the token (role server) this server presents to the other "
                            "servers; default: one made from --auth-token-secret")


def _superusers_arg(text: str) -> frozenset[str]:
    from sbp_spark.server.auth.authenticator import parse_superusers

    try:
        return parse_superusers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _auth_of(args: argparse.Namespace):
    """The authentication settings of the command line (open when none is given); key and
    token files are checked here, before anything starts."""
    from sbp_spark.server.auth.authenticator import AuthSettings

    auth = AuthSettings(token_secret_file=args.auth_token_secret,
                        token_public_key_file=args.auth_token_public_key,
                        certificates=args.tls_ca is not None and (
                            args.auth_token_secret is not None
                            or args.auth_token_public_key is not None
                            or bool(args.superusers)),
                        superusers=args.superusers, server_token_file=args.server_token)
    if args.server_token is not None and not auth.enabled:
        raise ValueError("--server-token needs authentication: --auth-token-secret or "
                         "--auth-token-public-key")
    auth.authenticator()
    auth.server_token()
    return auth


# -- running servers in the foreground ----------------------------------------------------------


class _StopSignals:
    """Turns SIGINT and SIGTERM into an event the main thread waits on."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name = ""
        # what signal.signal returned: a Python handler, SIG_DFL/SIG_IGN, or None
        self._previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    def __enter__(self) -> _StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name
        self.event.set()

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def wait(self, poll: Callable[[], None] | None = None, interval_s: float = 0.1) -> None:
        """Block until a stop signal; call ``poll()`` every ``interval_s`` meanwhile."""
        while not self.event.wait(interval_s):
            if poll is not None:
                poll()
        log.info("%s received: shutting down", self.signal_name or "stop")


# -- sbp server ---------------------------------------------------------------------------------


def _add_server(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "server", help="run a whole cluster (PD and range servers) in one process",
        description="Run a PD and N range servers in this process until SIGINT or SIGTERM. "
                    "With --pd-nodes, run a local etcd, that many PD nodes over it and the "
                    "range servers as child processes instead. Data survives restarts on the "
                    "same --data-dir.")
    parser.add_argument("--data-dir", required=True, metavar="DIR", help="where data is kept")
    parser.add_argument("--range-servers", type=int_in(1), default=1, metavar="N",
                        help="number of range servers (default 1)")
    parser.add_argument("--pd-nodes", type=int_in(1), default=None, metavar="N",
                        help="run a PD cluster of N nodes on a local etcd (needs the etcd "
                             "binary), each node and range server its own process; the first "
                             "node listens on --port, the others on free ports")
    _add_listen_args(parser, "PD", DEFAULT_PD_PORT)
    _add_advertise_args(parser, whole_address=False)
    _add_fsync_arg(parser)
    _add_page_cache_arg(parser)
    _add_metrics_arg(parser, "the PD's; range server i's on PORT + i + 1")
    _add_ready_file_arg(parser)
    _add_tls_args(parser)
    _add_auth_args(parser)
    parser.set_defaults(handler=server_command, command="sbp server")


def server_command(args: argparse.Namespace) -> int:
    if args.pd_nodes is not None:
        return _pd_cluster_command(args)
    from sbp_spark.server.cluster import EmbeddedCluster

    data_dir = _data_dir(args.data_dir)
    _check_range_server_count(data_dir, args.range_servers)
    cluster = EmbeddedCluster(data_dir, range_servers=args.range_servers, host=args.host,
                              pd_port=args.port, fsync=args.fsync,
                              fsync_interval_ms=args.fsync_interval_ms, tls=_tls_of(args),
                              page_cache_bytes=args.page_cache_mib << 20,
                              advertise_host=args.advertise_host,
                              metrics_port=args.metrics_port, auth=_auth_of(args))
    with _ready_file_writer(args.ready_file) as ready, _StopSignals() as stop:
        cluster.start()
        try:
            log.info("PD serving clients at %s", cluster.pd_address)
            for i, addr in enumerate(cluster.range_server_addresses):
                log.info("range server %d (id %d) serving clients at %s", i,
                         cluster.server_id(i), addr)
            if cluster.metrics_addresses:
                log.info("Prometheus metrics at %s", cluster.metrics_addresses)
            if args.ready_file is not None:
                ready({
                    "pd": cluster.pd_address,
                    "range_servers": cluster.range_server_addresses,
                    **({"metrics": cluster.metrics_addresses}
                       if cluster.metrics_addresses else {})})
            stop.wait()
        finally:
            cluster.stop()
    log.info("stopped")
    return 0


def _pd_cluster_command(args: argparse.Namespace) -> int:
    """``sbp server --pd-nodes N``: etcd, N PD nodes and the range servers as children."""
    from sbp_spark.server.cluster import ProcessCluster
    from sbp_spark.server.storage import DEFAULT_FSYNC_INTERVAL_MS

    if args.advertise_host is not None:
        raise ValueError("--advertise-host is not passed on to the processes --pd-nodes starts: "
                         "there every server listens on --host, which clients must reach")
    for option, value, default in (
            ("--metrics-port", args.metrics_port, None),
            ("--page-cache-mib", args.page_cache_mib, DEFAULT_PAGE_CACHE_BYTES >> 20),
            ("--fsync-interval-ms", args.fsync_interval_ms, DEFAULT_FSYNC_INTERVAL_MS)):
        if value != default:
            raise ValueError(f"{option} is not passed on to range server processes; run "
                             "without --pd-nodes, or start `sbp range-server` yourself")
    data_dir = _data_dir(args.data_dir)
    _check_range_server_count(data_dir, args.range_servers)
    cluster = ProcessCluster(data_dir, range_servers=args.range_servers,
                             host=args.host, fsync=args.fsync, pd_port=args.port,
                             tls=_tls_of(args), pd_nodes=args.pd_nodes, auth=_auth_of(args))
    with _ready_file_writer(args.ready_file) as ready, _StopSignals() as stop:
        cluster.start()
        try:
            log.info("etcd on %s; PD nodes %s; range servers %s",
                     ",".join(cluster.etcd_endpoints), cluster.pd_address,
                     ", ".join(cluster.range_server_addresses))
            if args.ready_file is not None:
                ready({
                    "pd": cluster.pd_address,
                    "range_servers": cluster.range_server_addresses,
                    "pd_nodes": cluster.pd_node_info(),
                    "etcd": cluster.etcd_endpoints})
            stop.wait(poll=lambda: _check_children(cluster))
        finally:
            cluster.stop()
    log.info("stopped")
    return 0


def _check_children(cluster) -> None:
    """Say so once when a child process of ``sbp server --pd-nodes`` exits on its own."""
    for proc in [*cluster.pd_nodes, *cluster.range_servers]:
        if proc is not None and not proc.running and not getattr(proc, "reported", False):
            proc.reported = True
            log.error("%s exited with status %s; its log: %s", " ".join(proc.args[3:5]),
                      proc.proc.returncode, proc.log_path)


# -- sbp pd -------------------------------------------------------------------------------------


def _add_pd(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pd", help="run a placement driver",
        description="Run a placement driver (stream and range metadata) until SIGINT or "
                    "SIGTERM: alone with its metadata in SQLite (--data-dir), or as one node "
                    "of a PD cluster whose metadata lives in etcd (--etcd, --name); the nodes "
                    "elect a leader there and followers redirect clients to it.")
    store = parser.add_mutually_exclusive_group(required=True)
    store.add_argument("--data-dir", metavar="DIR",
                       help="where a lone PD keeps its metadata (SQLite)")
    store.add_argument("--etcd", metavar="HOST:PORT[,HOST:PORT...]", type=_etcd_arg,
                       help="etcd client endpoints: keep the metadata in etcd and join the PD "
                            "cluster that leads there")
    parser.add_argument("--name", default=None, metavar="NAME",
                        help="this node's name in the PD cluster, unique in it (default pd-1)")
    parser.add_argument("--etcd-prefix", default=DEFAULT_ETCD_PREFIX, metavar="PREFIX",
                        help="the cluster's keys in etcd start with this, so clusters can "
                             f"share one etcd (default {DEFAULT_ETCD_PREFIX})")
    _add_listen_args(parser, "PD", DEFAULT_PD_PORT)
    _add_advertise_args(parser)
    parser.add_argument("--fsync", choices=FSYNC_CHOICES, default="group",
                        help="'never' skips the disk sync of metadata commits (default: sync)")
    _add_metrics_arg(parser, "on --host")
    _add_ready_file_arg(parser)
    _add_tls_args(parser)
    _add_auth_args(parser)
    parser.set_defaults(handler=pd_command, command="sbp pd")


def _etcd_arg(text: str) -> list[str]:
    from sbp_spark.server.etcd_client import parse_endpoints

    try:
        return parse_endpoints(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def pd_command(args: argparse.Namespace) -> int:
    from sbp_spark.server.net import NetConfig
    from sbp_spark.server.pd import PdConfig, PlacementDriver

    if args.etcd is None and (args.name is not None
                              or args.etcd_prefix != DEFAULT_ETCD_PREFIX):
        raise ValueError("--name and --etcd-prefix name a node of a PD cluster: give --etcd")
    data_dir = _data_dir(args.data_dir) if args.data_dir is not None else None
    pd = PlacementDriver(PdConfig(data_dir, host=args.host, port=args.port,
                                  advertise_addr=args.advertise_addr or "",
                                  advertise_host=args.advertise_host or "",
                                  name=args.name or "pd-1", fsync=args.fsync != "never",
                                  etcd=args.etcd or (), etcd_prefix=args.etcd_prefix,
                                  net=NetConfig(tls=_tls_of(args)),
                                  metrics_port=args.metrics_port, auth=_auth_of(args)))
    with _ready_file_writer(args.ready_file) as ready, _StopSignals() as stop:
        try:
            pd.start()
            log.info("PD %s listening on %s", pd.config.name, pd.address)
            if args.ready_file is not None:
                info = {"pd": pd.address}
                if pd.metrics_server is not None:
                    info["metrics"] = pd.metrics_server.address
                if args.etcd:
                    info["name"] = pd.config.name
                ready(info)
            stop.wait()
        finally:
            pd.stop()
    log.info("stopped")
    return 0


# -- sbp range-server ---------------------------------------------------------------------------


def _add_range_server(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "range-server", help="run a range server",
        description="Run a range server that registers with the PD and serves the ranges it "
                    "places here, until SIGINT or SIGTERM. The server id is kept in --data-dir.")
    # From the environment too, so a deployment names its PD address list once (the
    # compose file sets $SBP_PD for every service); unlike the admin commands there is no
    # 127.0.0.1 default: a server must be told where its PD is.
    env_pd = os.environ.get(PD_ENV) or None
    parser.add_argument("--pd", required=env_pd is None, default=env_pd, type=pd_addresses_arg,
                        metavar="HOST:PORT",
                        help=f"the PD's address (several: comma-separated; default: ${PD_ENV}, "
                             f"and one of the two is required)")
    parser.add_argument("--data-dir", required=True, metavar="DIR", help="where data is kept")
    _add_listen_args(parser, "range server")
    _add_advertise_args(parser)
    _add_fsync_arg(parser)
    _add_page_cache_arg(parser)
    _add_metrics_arg(parser, "on --host")
    _add_ready_file_arg(parser)
    _add_tls_args(parser)
    _add_auth_args(parser)
    parser.set_defaults(handler=range_server_command, command="sbp range-server")


def range_server_command(args: argparse.Namespace) -> int:
    from sbp_spark.client.pd import parse_pd_addresses
    from sbp_spark.server.net import NetConfig
    from sbp_spark.server.range_server import RangeServer, RangeServerConfig
    from sbp_spark.server.storage import StorageConfig

    data_dir = _data_dir(args.data_dir)
    rs = RangeServer(RangeServerConfig(
        data_dir=str(data_dir), host=args.host, port=args.port,
        advertise_addr=args.advertise_addr, advertise_host=args.advertise_host,
        pd_addresses=parse_pd_addresses(args.pd),
        storage=StorageConfig(fsync=args.fsync, fsync_interval_ms=args.fsync_interval_ms,
                              page_cache_bytes=args.page_cache_mib << 20),
        net=NetConfig(name="range-server", tls=_tls_of(args)),
        metrics_port=args.metrics_port, auth=_auth_of(args)))
    announced = False
    # A PD that refuses the server's id for good ends the command (no ready file), with the
    # refusal as its error: the server then does not log it too.
    refused: list[Exception] = []
    rs.on_refusal = refused.append

    def announce_when_registered() -> None:
        # The PD may be down at first: the server keeps trying, and says so once it is in.
        nonlocal announced
        if refused:
            raise refused[0]
        link = rs.pd_link
        if announced or link is None or not link.registered.is_set() or link.heartbeats < 1:
            return
        announced = True
        log.info("range server %d listening on %s, registered with the PD at %s",
                 rs.server_id, rs.advertise_addr, args.pd)
        if args.ready_file is not None:
            ready({"range_server": rs.advertise_addr, "server_id": rs.server_id,
                   **({"metrics": rs.metrics_server.address}
                      if rs.metrics_server is not None else {})})

    with _ready_file_writer(args.ready_file) as ready, _StopSignals() as stop:
        try:
            rs.start()
            announce_when_registered()
            stop.wait(poll=announce_when_registered)
        finally:
            rs.stop()
    log.info("stopped")
    return 0
