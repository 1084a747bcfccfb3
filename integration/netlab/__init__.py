"""A network you can break, on one machine: network namespaces joined by a bridge, with silent
partitions (whole nodes, pairs, one direction), link failures, and added latency and bandwidth
limits (a userspace delay line: this kernel has no netem).

``network.Network`` builds and breaks the network; ``delay`` is the delay-line proxy it starts
for slow links; ``reaper`` makes sure a test run, even a killed one, leaves no process or
namespace behind. Used by the partition cases (``integration/faults/test_partitions.py``) and the
slow-link benchmark (``integration/bench/slow_links.py``). Needs root.
"""
