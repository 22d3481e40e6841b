"""Helpers shared by the test suites: the child environment, stand-ins, worker scripts.

`tests.helpers.env` must be imported before anything imports jax (tests/conftest.py does it
first): it gives the pytest process 8 CPU devices and one compilation cache per session.
"""
