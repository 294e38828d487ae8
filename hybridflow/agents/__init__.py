"""Agentic RL: environments, tools, tool-call parsing and execution for multi-turn episodes (docs/agents.md)."""

from typing import TYPE_CHECKING

from hybridflow._lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools (type checkers, IDEs, tests/test_layering.py)
    from hybridflow.agents.builtin_tools import DocumentSearch, calculator, python_tool
    from hybridflow.agents.config import EnvConfig
    from hybridflow.agents.env import (
        AssistantTurn,
        Environment,
        EnvironmentFailure,
        EpisodeStart,
        Message,
        TurnResult,
        row_messages,
    )
    from hybridflow.agents.loading import (
        EnvironmentDefinitionError,
        check_environment,
        checked_close,
        checked_start,
        checked_step,
        load_environment,
        make_environment,
    )
    from hybridflow.agents.openai_env import OpenAIAgentEnvironment
    from hybridflow.agents.single_turn import RewardFunctionEnvironment
    from hybridflow.agents.tool_calls import (
        HermesParser,
        Llama3Parser,
        ToolOutcome,
        arun_tool_calls,
        make_parser,
        parser_for_template,
        run_tool_calls,
        tool_metrics,
    )
    from hybridflow.agents.tool_env import ToolEnvironment
    from hybridflow.agents.tools import Tool, ToolArgumentError, ToolCall, tool

# submodules load on first use: the environment interface stays torch-free (the reward adapter and the
# sandboxed tool import hybridflow.rewards, which needs torch)
_EXPORTS = {
    "AssistantTurn": "hybridflow.agents.env",
    "DocumentSearch": "hybridflow.agents.builtin_tools",
    "EnvConfig": "hybridflow.agents.config",
    "Environment": "hybridflow.agents.env",
    "EnvironmentDefinitionError": "hybridflow.agents.loading",
    "EnvironmentFailure": "hybridflow.agents.env",
    "EpisodeStart": "hybridflow.agents.env",
    "HermesParser": "hybridflow.agents.tool_calls",
    "Llama3Parser": "hybridflow.agents.tool_calls",
    "Message": "hybridflow.agents.env",
    "OpenAIAgentEnvironment": "hybridflow.agents.openai_env",
    "RewardFunctionEnvironment": "hybridflow.agents.single_turn",
    "Tool": "hybridflow.agents.tools",
    "ToolArgumentError": "hybridflow.agents.tools",
    "ToolCall": "hybridflow.agents.tools",
    "ToolEnvironment": "hybridflow.agents.tool_env",
    "ToolOutcome": "hybridflow.agents.tool_calls",
    "TurnResult": "hybridflow.agents.env",
    "arun_tool_calls": "hybridflow.agents.tool_calls",
    "calculator": "hybridflow.agents.builtin_tools",
    "check_environment": "hybridflow.agents.loading",
    "checked_close": "hybridflow.agents.loading",
    "checked_start": "hybridflow.agents.loading",
    "checked_step": "hybridflow.agents.loading",
    "load_environment": "hybridflow.agents.loading",
    "make_environment": "hybridflow.agents.loading",
    "make_parser": "hybridflow.agents.tool_calls",
    "parser_for_template": "hybridflow.agents.tool_calls",
    "python_tool": "hybridflow.agents.builtin_tools",
    "row_messages": "hybridflow.agents.env",
    "run_tool_calls": "hybridflow.agents.tool_calls",
    "tool": "hybridflow.agents.tools",
    "tool_metrics": "hybridflow.agents.tool_calls",
}
__all__ = [
    "AssistantTurn", "DocumentSearch", "EnvConfig", "Environment", "EnvironmentDefinitionError",
    "EnvironmentFailure", "EpisodeStart", "HermesParser", "Llama3Parser", "Message", "OpenAIAgentEnvironment",
    "RewardFunctionEnvironment",
    "Tool", "ToolArgumentError", "ToolCall", "ToolEnvironment", "ToolOutcome", "TurnResult", "arun_tool_calls",
    "calculator", "check_environment", "checked_close", "checked_start", "checked_step", "load_environment",
    "make_environment", "make_parser", "parser_for_template", "python_tool", "row_messages", "run_tool_calls",
    "tool", "tool_metrics",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
