"""hookbus.demo: the application behind `hookbus demo`, an example of hookbus at work.

A fleet of agents replays ``<examples>/transcript.json`` against hook workers running as
separate processes (see `hookbus.demo._app`). It is built on the CLI's pieces (connections,
the embedded nats-server, `hookbus auth`'s files, provisioning, OpenTelemetry) and the
CLI reaches it only lazily: the ``demo`` command and ``hookbus auth init --demo`` import
it when they run, never at import time, and no other module of ours imports it.
"""

from ._agents import parse_agents
from ._app import demo_identities, demo_main, find_examples_dir, run, secure_credentials

__all__ = [
    "demo_identities",
    "demo_main",
    "find_examples_dir",
    "parse_agents",
    "run",
    "secure_credentials",
]
