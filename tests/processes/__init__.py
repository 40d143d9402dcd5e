"""Tests that start ordinary processes of their own, quickly: ddpmon's commands as a user runs
them, processes standing in for ranks (sleeping, stopped, killed, a zombie), a script run to
its exit or killed mid-write. No DDP job (tests/distributed) and no program beyond the OS's
own (tests/integration). ``make test-fast`` runs them with tests/unit."""
