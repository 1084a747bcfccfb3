"""The nemesis: every kind of fault the cluster must ride out, combined at random from a seed,
for minutes on end, against a cluster on a network of namespaces with writers, tails and Spark
jobs at work, judged by the history checker and the relay's exactly-once check.

``schedule`` draws the faults from the seed (and states the rule that keeps them survivable),
``faults`` injects and undoes each kind on the test bench (``integration/faults/lab.py``),
``spark_jobs`` is the process running the Spark batch loop and streaming relay, ``run`` puts
a run together and ``judge`` gives its figures and checks them against issue 43's definition
of done. ``python -m integration.nemesis --minutes M --seed N`` runs one; ``test_nemesis.py``
is the 10-minute run as a slow test. Needs root (network namespaces), etcd and Java.
"""
