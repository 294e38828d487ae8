"""The calculator example that learns: a short SFT on tool-call demonstrations, then GRPO with the calculator
environment, and the held-out tool-call rate and accuracy (greedy episodes) before and after RL.

    python examples/agents/calculator_learns.py runs/calclearn            # the defaults, measured in docs/agents.md
    python examples/agents/calculator_learns.py runs/calclearn --grpo-steps 2 --sft-steps 20   # a smoke run
    python examples/agents/calculator_learns.py runs/calcsmol --model smollm2 --task product ...  # docs/agents.md

Stages (all on CPU, nothing downloaded):
0. the tiny chat model of ``examples/episodes/make_chat_model.py`` (character tokenizer, ChatML with tools,
   random 4-layer Llama), its end of turn ``<|im_end|>`` made the tokenizer's EOS so that SFT responses end
   the way the episode runner's turns do;
1. ``hybridflow sft`` on the demonstrations of an *inconsistent demonstrator*: on ``tool_share`` of the
   questions it calls the calculator and copies the result (``demonstration(row)``), on the others it writes the
   right answer straight away, which a model this small cannot compute, so the policy learns both habits;
2. GRPO with ``env.class: examples/agents/calculator_env.py:CalculatorEnvironment`` from the SFT model: an
   episode that calls the tool and copies its result is rewarded, a guessed answer rarely is;
3. greedy episodes on held-out questions, run here with ``transformers`` through the same prompt and observation
   ids as the episode runner (``ChatTokens``), before and after GRPO: the share of episodes that called the
   calculator and the share answered right. ``summary.json`` holds them with the run's times.

``--model smollm2`` (the converted checkpoint of ``scripts/get_smollm2.py``) or ``--model DIR`` (a Hugging Face
directory with a chat template whose end of turn is ``<|im_end|>``) starts stage 1 from that model instead. A chat
template that renders no ``tools=`` (SmolLM2's) gets the tools in the system prompt
(``calculator_smollm2.PromptedCalculatorEnvironment``), everywhere: SFT rows, GRPO episodes and evaluation.
``--task product`` asks for products of two 2-digit numbers instead of the mixed two-to-four-operand questions.

``--agent endpoint`` runs stage 2 through the OpenAI-compatible endpoint instead: the episodes are driven by an agent
program written against the ``openai`` client (``calculator_endpoint.CalculatorAgent``, or
``calculator_smollm2.PromptedCalculatorAgent`` where the template renders no tools: the program writes them into its
system prompt), and the step trains the ids the endpoint recorded. Stages 1 and 3 are the same, so the two paths
compare directly; the tools run in the agent program, which hybridflow does not see, so every episode is recorded
(``grpo/episodes.jsonl``) and the curve counts the calls from the recorded replies (``endpoint/*``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = ("tiny", "smollm2")
"""Named starting points of ``--model`` (anything else is a Hugging Face directory)."""
TASKS = ("mixed", "product")
AGENTS = ("environment", "endpoint")
"""How GRPO runs the episodes (``--agent``): stepping the in-process environment, or an ``openai``-client agent
program through the OpenAI-compatible endpoint."""


@dataclass(frozen=True, kw_only=True)
class LearnsConfig:
    """Sizes of the run (defaults: the first run measured in docs/agents.md, "An example that learns")."""

    output_dir: str = "runs/calclearn"
    seed: int = 0
    model: str = "tiny"
    """"tiny" (the random tiny chat model), "smollm2" (SmolLM2-135M-Instruct) or a Hugging Face directory."""
    task: str = "mixed"
    """"mixed": two to four operands of 1-99 with + - * (``make_rows``); "product": a * b of 10-99
    (``calculator_smollm2.product_rows``)."""
    num_train: int = 256
    """Calculator questions for SFT and GRPO (the same questions; the held-out ones are never trained on)."""
    num_val: int = 64
    """Held-out questions, disjoint from the training ones."""
    tool_share: float = 0.5
    """Share of the SFT demonstrations that call the calculator (the others answer at once)."""
    hidden_size: int = 64
    """Width of the random 4-layer Llama (64: the tutorial's tiny chat model)."""
    sft_steps: int = 300
    sft_lr: float = 3e-3
    sft_batch_size: int = 16
    grpo_steps: int = 30
    grpo_lr: float = 3e-4
    kl_mode: str = "auto"
    """``algorithm.kl_mode`` of GRPO ("none" builds no reference model: a faster step)."""
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    val_every: int = 10
    max_new_tokens: int = 96
    """Per turn: a calculator call of the longest questions is about 90 characters."""
    agent: str = "environment"
    """"environment": GRPO steps the calculator environment in process; "endpoint": an agent program written against
    the ``openai`` client drives the GRPO episodes through the OpenAI-compatible endpoint (SFT and the held-out
    evaluation are the same either way)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.tool_share <= 1.0:
            raise ValueError(f"tool_share got {self.tool_share!r}; allowed: a number in [0, 1]")
        if self.task not in TASKS:
            raise ValueError(f"task got {self.task!r}; allowed: {', '.join(TASKS)}")
        if self.agent not in AGENTS:
            raise ValueError(f"agent got {self.agent!r}; allowed: {', '.join(AGENTS)}")
        if self.model not in MODELS and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model got {self.model!r}; allowed: {', '.join(MODELS)} or a Hugging Face directory")
        for name in ("num_train", "num_val", "sft_steps", "grpo_steps", "prompts_per_step", "samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} got {getattr(self, name)!r}; allowed: an integer >= 1")


def _examples():
    """The calculator environment module and the tiny chat model module (both example files, not a package)."""
    sys.path[:0] = [str(HERE), str(HERE.parent / "episodes")]
    import calculator_env
    import make_chat_model

    return calculator_env, make_chat_model


def _prompted():
    """``calculator_smollm2.py`` beside this file: the tools-in-the-system-prompt environment and the products."""
    _examples()
    import calculator_smollm2

    return calculator_smollm2


def environment_for(tokenizer):
    """The environment class for ``tokenizer``'s chat template: ``CalculatorEnvironment`` where the template renders
    ``tools=``, else ``PromptedCalculatorEnvironment`` (the tools in the system prompt)."""
    prompted = _prompted()
    return prompted.CalculatorEnvironment if prompted.template_renders_tools(tokenizer) \
        else prompted.PromptedCalculatorEnvironment


def endpoint_agent_for(tokenizer):
    """The agent program that drives GRPO through the endpoint (``--agent endpoint``) for ``tokenizer``'s chat
    template: ``CalculatorAgent`` (the tools in ``tools=``), else ``PromptedCalculatorAgent`` (also in its system
    prompt); either sends the messages ``environment_for(tokenizer)`` opens with."""
    prompted = _prompted()
    import calculator_endpoint  # beside this file, on the path since _prompted()

    return calculator_endpoint.CalculatorAgent if prompted.template_renders_tools(tokenizer) \
        else prompted.PromptedCalculatorAgent


def endpoint_overrides(config: LearnsConfig) -> list[str]:
    """The GRPO config of the endpoint path: every episode recorded (the agent runs the tools, so the records'
    replies are where its calls are counted), and an agent time limit past the slowest CPU step measured."""
    return ["env.record_every=1", f"env.record_episodes={config.prompts_per_step * config.samples_per_prompt}",
            "env.agent_timeout_s=7200"]


def recorded_calls(path: Path) -> dict[int, dict[str, float]]:
    """Per step of an ``episodes.jsonl``: the chat-completion calls (turns) and the tool calls (of the replies,
    as the endpoint parsed them) per recorded episode."""
    steps: dict[int, list[dict]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], []).append(record)
    counts = {}
    for step, records in steps.items():
        calls = [len(message.get("tool_calls") or []) for record in records for message in record["messages"]
                 if message["role"] == "assistant"]
        counts[step] = {"endpoint/calls_per_episode": sum(record["turns"] for record in records) / len(records),
                        "endpoint/tool_calls_per_episode": sum(calls) / len(records)}
    return counts


def environment_spec(environment) -> str:
    """``env.class`` of an environment class defined in this directory."""
    return f"{HERE / (environment.__module__ + '.py')}:{environment.__name__}"


def base_model(config: "LearnsConfig", root: Path) -> Path:
    """Where stage 1 starts: the tiny model built under ``root/base``, SmolLM2's converted checkpoint, or a path."""
    if config.model == "tiny":
        return build_base(root / "base", config.seed, config.hidden_size)
    if config.model == "smollm2":
        from hybridflow.models import smollm2_path

        found = smollm2_path()
        if found is None:
            raise SystemExit("SmolLM2-135M-Instruct is not converted yet: run python scripts/get_smollm2.py")
        return Path(found)
    return Path(config.model)


def build_base(directory: Path, seed: int, hidden_size: int = 64) -> Path:
    """The random tiny chat model (``hidden_size`` wide); its tokenizer's EOS is ``<|im_end|>``, the end of an
    assistant turn."""
    import torch
    from transformers import LlamaForCausalLM

    _, chat = _examples()
    tokenizer = chat.chat_tokenizer()
    tokenizer.eos_token = "<|im_end|>"
    config = chat.build_model(tokenizer, seed=seed).config
    config.update({"hidden_size": hidden_size, "intermediate_size": 2 * hidden_size})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def split_rows(config: LearnsConfig) -> tuple[list[dict], list[dict]]:
    """(training questions, held-out questions), disjoint by expression."""
    calculator_env, _ = _examples()
    make_rows = calculator_env.make_rows if config.task == "mixed" else _prompted().product_rows
    train = make_rows(config.num_train, seed=config.seed)
    seen = {row["expression"] for row in train}
    candidates = make_rows(4 * config.num_val, seed=config.seed + 1)
    val = [row for row in candidates if row["expression"] not in seen][:config.num_val]
    return train, val


def sft_rows(rows: list[dict], tokenizer, *, tool_share: float, seed: int, environment=None) -> list[dict]:
    """Prompt/response rows of the demonstrations, prompts rendered as the episode runner renders them (the
    opening of ``environment``, by default ``CalculatorEnvironment``, with its tools).

    A tool-using demonstration gives two rows (the call after the opening; the answer after the call and its
    result), so only the assistant's turns carry loss; a direct one gives one row (the answer after the opening).
    """
    from hybridflow.agents import checked_start, make_environment
    from hybridflow.agents.episode import ChatTokens

    calculator_env, _ = _examples()
    environment = environment or calculator_env.CalculatorEnvironment
    chat, generator, out = ChatTokens(tokenizer), random.Random(seed), []
    for row in rows:
        start = checked_start(make_environment(environment), row)
        tools = [tool.schema for tool in start.tools]
        _, _, call, result, answer = calculator_env.demonstration(row)
        opening = chat.tokenizer.apply_chat_template(start.messages, tools=tools, tokenize=False,
                                                     add_generation_prompt=True)
        if generator.random() < tool_share:
            after_call = opening + call["content"] + chat.observation_text([result], tools)
            out += [{"prompt": opening, "response": call["content"]},
                    {"prompt": after_call, "response": answer["content"]}]
        else:
            out.append({"prompt": opening, "response": answer["content"]})
    return out


def greedy_turns(model, prompts: list[list[int]], *, max_new_tokens: int, end: int, pad: int,
                 temperature: float | None = None) -> list[list[int]]:
    """One turn for each of ``prompts`` (token ids), generated together with left padding: greedy, or sampled at
    ``temperature`` from the whole distribution (no top-k, no top-p); each turn's ids up to and including its first
    ``end``, or ``max_new_tokens`` ids when it did not end."""
    import torch

    width = max(len(ids) for ids in prompts)
    input_ids_bt = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
    mask_bt = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    decoding = (dict(do_sample=False) if temperature is None
                else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0))
    with torch.no_grad():
        output_bt = model.generate(input_ids=input_ids_bt, attention_mask=mask_bt, max_new_tokens=max_new_tokens,
                                   eos_token_id=end, pad_token_id=pad, **decoding)
    turns = []
    for sampled in output_bt[:, width:].tolist():
        turns.append(sampled[:sampled.index(end) + 1] if end in sampled else sampled)
    return turns


def evaluate(model_dir: str | Path, rows: list[dict], *, max_new_tokens: int, max_turns: int = 3,
             environment=None, batch_size: int = 32, samples: int = 1, temperature: float | None = None,
             seed: int = 0) -> dict:
    """Episodes of ``rows`` with ``environment`` (by default ``CalculatorEnvironment``), each turn of up to
    ``batch_size`` episodes generated together: greedy (``temperature`` None), or ``samples`` episodes per row
    sampled at ``temperature`` (torch seeded with ``seed``, so a rerun draws the same). Returns
    ``tool_call_rate`` (episodes that called a tool at least once), ``accuracy`` (mean reward), ``turns_mean``
    and ``row_rewards`` (each row's mean reward over its episodes, in the order of ``rows``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.agents import AssistantTurn, HermesParser, checked_start, checked_step, make_environment
    from hybridflow.agents.episode import ChatTokens

    if samples < 1 or (temperature is None and samples != 1):
        raise ValueError(f"samples got {samples!r}; allowed: 1 for greedy episodes, an integer >= 1 with a "
                         f"temperature")
    calculator_env, _ = _examples()
    environment = environment or calculator_env.CalculatorEnvironment
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    chat, parser, end = ChatTokens(tokenizer), HermesParser(), tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = end if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    torch.manual_seed(seed)
    episodes = []
    for index, row in enumerate(rows):
        for _ in range(samples):
            episode_env = make_environment(environment)
            opening = checked_start(episode_env, row)
            tools = [tool.schema for tool in opening.tools]
            episodes.append({"env": episode_env, "tools": tools, "ids": chat.prompt_ids(opening.messages, tools),
                             "row": index, "called": False, "reward": 0.0, "turns": 0, "done": False})
    for turn in range(max_turns):
        live = [episode for episode in episodes if not episode["done"]]
        for first in range(0, len(live), batch_size):
            chunk = live[first:first + batch_size]
            outputs = greedy_turns(model, [episode["ids"] for episode in chunk], max_new_tokens=max_new_tokens,
                                   end=end, pad=pad, temperature=temperature)
            for episode, sampled in zip(chunk, outputs):
                text = tokenizer.decode(sampled, skip_special_tokens=True)
                parsed = parser.parse(text, id_prefix=f"turn{turn}")
                episode["called"] = episode["called"] or bool(parsed.calls)
                episode["turns"] = turn + 1
                result = checked_step(episode["env"], AssistantTurn(text, parsed.calls, parsed.errors, turn))
                # an EnvironmentFailure (no done, no reward) ends it with reward 0, as on_env_error: zero_reward
                if getattr(result, "done", True) or turn + 1 == max_turns:
                    episode["reward"], episode["done"] = float(getattr(result, "reward", None) or 0.0), True
                    continue
                closed = "<|im_end|>" if sampled and sampled[-1] == end else None
                episode["ids"] = episode["ids"] + sampled + chat.observation_ids(result.messages, episode["tools"],
                                                                                 closed_by=closed)
    count = len(episodes)
    row_rewards = [sum(episode["reward"] for episode in episodes if episode["row"] == index) / samples
                   for index in range(len(rows))]
    return {"tool_call_rate": sum(episode["called"] for episode in episodes) / count,
            "accuracy": sum(episode["reward"] for episode in episodes) / count,
            "turns_mean": sum(episode["turns"] for episode in episodes) / count, "row_rewards": row_rewards}


def train_sft(config: LearnsConfig, data_file: Path, base_dir: Path, output_dir: Path) -> Path:
    from hybridflow.trainers.supervised import SFTConfig, load_supervised_config, run_supervised

    run_supervised(load_supervised_config(SFTConfig, None, [
        f"model.path={base_dir}", f"data.train_path={data_file}", "data.chat_template=never",
        "data.max_prompt_tokens=512", "data.max_response_tokens=128", f"output_dir={output_dir}", "overwrite=true",
        f"batch_size={config.sft_batch_size}", "epochs=1000", f"max_steps={config.sft_steps}",
        f"engine.optim.lr={config.sft_lr}", f"engine.optim.warmup_steps={max(1, config.sft_steps // 10)}",
        "engine.optim.lr_schedule=cosine", "engine.dtype=float32", f"seed={config.seed}", "progress_bar=false",
        "eval_before_train=false"]), mode="local", tensorboard=False)
    return output_dir / "model"


def train_grpo(config: LearnsConfig, files: dict[str, Path], policy_dir: Path, output_dir: Path,
               env_spec: str, extra_overrides: list[str] | None = None) -> list[dict]:
    """GRPO from ``policy_dir`` with ``env.class: env_spec``; ``extra_overrides`` come last (they win)."""
    from hybridflow.controller import local_mode
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import RLTrainer

    rl_config = load_rl_config(None, [
        f"data.train_path={files['train']}", f"data.val_path={files['val']}", "data.max_prompt_tokens=512",
        f"actor.model.path={policy_dir}", f"actor.engine.optim.lr={config.grpo_lr}",
        "actor.engine.dtype=float32", "reference.engine.dtype=float32",
        f"actor.generation.max_new_tokens={config.max_new_tokens}", f"env.class={env_spec}", "env.max_turns=3",
        "env.max_episode_tokens=768", "env.tool_timeout_s=5", f"env.record_every={config.val_every}",
        "env.decode_chunk_tokens=32", "env.tool_format=hermes",  # the demonstrations' and evaluate's format
        "algorithm.advantage_estimator=grpo", f"algorithm.kl_mode={config.kl_mode}",
        f"batch.prompts_per_step={config.prompts_per_step}",
        f"batch.samples_per_prompt={config.samples_per_prompt}",
        f"batch.mini_batch_size={config.prompts_per_step * config.samples_per_prompt}",
        f"trainer.total_steps={config.grpo_steps}", f"trainer.val_every={config.val_every}",
        f"trainer.output_dir={output_dir}", f"trainer.seed={config.seed}", "trainer.resume=false",
        "trainer.overwrite=true", "trainer.progress_bar=false", *(extra_overrides or [])])
    with local_mode():
        trainer = RLTrainer(rl_config, tensorboard=False)
        try:
            return trainer.fit()
        finally:
            trainer.shutdown()


def run(config: LearnsConfig) -> dict:
    """All stages; returns (and writes to ``output_dir/summary.json``) the before/after numbers and times."""
    from transformers import AutoTokenizer

    from hybridflow.data import write_jsonl

    root = Path(config.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    started, times = time.perf_counter(), {}
    base_dir = base_model(config, root)
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    environment = environment_for(tokenizer)
    train, val = split_rows(config)
    files = {"train": write_jsonl(root / "train.jsonl", train), "val": write_jsonl(root / "val.jsonl", val)}
    demos = sft_rows(train, tokenizer, tool_share=config.tool_share, seed=config.seed, environment=environment)
    files["sft"] = write_jsonl(root / "sft.jsonl", demos)
    policy_dir = train_sft(config, files["sft"], base_dir, root / "sft")
    times["sft_s"] = time.perf_counter() - started
    before = evaluate(policy_dir, val, max_new_tokens=config.max_new_tokens, environment=environment)
    print(f"after SFT ({len(demos)} demonstration rows, {config.sft_steps} steps): {before}", flush=True)
    mark = time.perf_counter()
    endpoint = config.agent == "endpoint"
    trained = endpoint_agent_for(tokenizer) if endpoint else environment
    history = train_grpo(config, files, policy_dir, root / "grpo", environment_spec(trained),
                         endpoint_overrides(config) if endpoint else None)
    times["grpo_s"] = time.perf_counter() - mark
    after = evaluate(root / "grpo" / "final" / "actor", val, max_new_tokens=config.max_new_tokens,
                     environment=environment)
    print(f"after GRPO ({config.grpo_steps} steps): {after}", flush=True)
    times["total_s"] = time.perf_counter() - started
    curve = [{key: record[key] for key in ("step", "reward/score_mean", "agent/tool_calls_per_episode",
                                             "val/score_mean") if key in record} for record in history]
    if endpoint:  # agent/tool_calls_per_episode counts the tools hybridflow runs (none here): the records count
        counts = recorded_calls(root / "grpo" / "episodes.jsonl")
        curve = [{**{key: value for key, value in point.items() if key != "agent/tool_calls_per_episode"},
                  **counts.get(point["step"], {})} for point in curve]
    summary = {"before": before, "after": after, "times": times, "curve": curve, "config": asdict(config)}
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir")
    for name, default in asdict(LearnsConfig()).items():
        if name != "output_dir":
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    arguments = vars(parser.parse_args(argv))
    summary = run(LearnsConfig(**arguments))
    print(json.dumps({key: summary[key] for key in ("before", "after", "times")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
