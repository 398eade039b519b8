"""Adapters that make hookbus the hook layer of agent frameworks people already run.

Each adapter is its own module with its own optional extra, so an agent that uses none of
them installs only hookbus's lean core:

- `hookbus.integrations.pydantic_ai` (extra ``pydantic-ai``)
- `hookbus.integrations.openai_agents` (extra ``openai-agents``: the OpenAI Agents SDK)
- `hookbus.integrations.ai` (extra ``ai``: the Vercel AI SDK for Python)
- `hookbus.integrations.langgraph` (extra ``langgraph``: the tool node of a LangGraph graph)
- `hookbus.integrations.claude_agent_sdk` (extra ``claude-agent-sdk``: the Claude Agent SDK
  for Python's hook callbacks, answered by the Claude Code door)
- `hookbus.integrations.claude_code` (no extra: Claude Code's command and HTTP hooks)
- `hookbus.integrations.gateway` (extra ``gateway``: the doors over HTTP, one Starlette app
  that `hookbus gateway http|aos` serves with uvicorn)
- `hookbus.integrations.console` (extra ``gateway``: the approvals console in a browser,
  one Starlette app that `hookbus console` serves with uvicorn)
"""

from ._emit import Emit

__all__ = ["Emit"]
