"""RewardWorker (and CostWorker): a reward model's score of each (prompt, response).

Two kinds of reward model (see hybridflow.workers.supervised): a ``score`` head read at the last
real token, or a likelihood reward model (``lm`` head) whose score is the sum of the response
tokens' log-probs. The latter also returns those per-token terms (``rm_token_scores``) so PPO can
credit every token with its own share, unless the response had to be re-tokenized (its tokens no
longer line up with the actor's; then only the sum is returned).

When the reward model's tokenizer differs from the actor's, the responses are decoded to text and
re-encoded (prompt from the row's raw text with the reward tokenizer's chat template, response
followed by its EOS), so a reward model of another family scores what the actor actually wrote.
Shape legend: B = samples on this rank, P = prompt tokens, T = response tokens.
"""

from __future__ import annotations

from hybridflow.controller import register
from hybridflow.data import PromptEncoder, decode_responses, prompt_response_tensors
from hybridflow.protocol import DataProto
from hybridflow.workers.base import SEQUENCE_KEYS, ModelWorker, tensors_of
from hybridflow.workers.spec import RewardSpec


class RewardWorker(ModelWorker):
    """Sequence scores from a reward model, re-tokenizing when its tokenizer is not the actor's."""

    TRAINABLE = False

    def __init__(self, spec: RewardSpec) -> None:
        super().__init__(spec.engine)
        self.reward_spec = spec
        self.actor_tokenizer = None
        self.encoder = None
        if spec.tokenizer is not None and spec.tokenizer != spec.actor_tokenizer:
            self.actor_tokenizer = spec.actor_tokenizer.load()
            self.encoder = PromptEncoder(spec.tokenizer.load())

    def _model_inputs(self, data: DataProto) -> dict:
        if self.encoder is None:
            return tensors_of(data, SEQUENCE_KEYS)
        if "raw_prompt" not in data.non_tensor_batch:
            raise ValueError("re-tokenizing for the reward model needs the rows' 'raw_prompt' texts; "
                             f"the batch has {sorted(data.non_tensor_batch)}")
        texts = [self.encoder.prompt_text({"prompt": str(prompt)}, row_index=row, source_name="batch")[0]
                 for row, prompt in enumerate(data["raw_prompt"])]
        prompt_ids = [ids[-self.reward_spec.max_prompt_tokens:] for ids in self.encoder.encode_prompts(texts)]
        response_ids = self.encoder.encode_responses(decode_responses(self.actor_tokenizer, data))
        tokenizer = self.encoder.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return prompt_response_tensors(prompt_ids, response_ids, pad_token_id=pad)

    def _token_scores(self, data: DataProto):
        """Likelihood reward models: per-token log-probs of the response [B, T] (0 on padding)."""
        inputs = self._model_inputs(data)
        logprobs_BT = self.engine.forward(inputs, outputs=("logprobs",))["logprobs"]
        return logprobs_BT * inputs["response_mask"].to(logprobs_BT)

    def _scores(self, data: DataProto):
        if self.engine.head == "lm":
            return self._token_scores(data).sum(dim=-1)
        return self.engine.forward(self._model_inputs(data), outputs=("scores",))["scores"]

    @register("3D_PROTO")
    def compute_reward(self, data: DataProto) -> DataProto:
        """``rm_scores`` [B]: the reward model's score of each (prompt, response); a likelihood reward
        model on the actor's own tokens adds ``rm_token_scores`` [B, T] (the per-token terms of that sum)."""
        if self.engine.head != "lm":
            return DataProto.from_dict(tensors={"rm_scores": self._scores(data)})
        token_scores_BT = self._token_scores(data)
        tensors = {"rm_scores": token_scores_BT.sum(dim=-1)}
        if self.encoder is None:  # the actor's own tokens: the per-token terms line up with its responses
            tensors["rm_token_scores"] = token_scores_BT
        return DataProto.from_dict(tensors=tensors)


class CostWorker(RewardWorker):
    """A cost model (Safe-RLHF): same model shape as a reward model, its output named ``costs``."""

    @register("3D_PROTO")
    def compute_cost(self, data: DataProto) -> DataProto:
        """``costs`` [B]: the cost model's score of each (prompt, response)."""
        return DataProto.from_dict(tensors={"costs": self._scores(data)})
