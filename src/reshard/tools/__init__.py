"""The tooling around the library: the ``reshard`` command (plan, bench, simulate), the
benchmark harness, emulated nodes in network namespaces, a process launcher for tests and
examples, synthetic weight contents, and the demos. Nothing in the library imports it."""
