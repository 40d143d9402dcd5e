"""The developer's generators, run from a source checkout (``python -m tools.NAME``, the
Makefile's targets): they write the checked-in files that the tests compare with the code.
Not part of the installed package; nothing in ``ddpmon`` imports them."""
