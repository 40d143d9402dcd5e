"""Readers of node daemons from another machine, for the offline commands (doctor, report,
compare): ``daemons.py`` reads their ``/state`` and ``/history`` under one deadline,
``discovery.py`` finds them (a file of addresses, Prometheus' targets). Torch-free; the
node daemon itself is ``ddpmon/daemon/``."""
