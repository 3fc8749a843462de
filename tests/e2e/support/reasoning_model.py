"""A tiny random-init Qwen3 checkpoint that "reasons" on cue, for the wiring of
require_reasoning through the gateway.

The tokenizer is the default model's (exported) with ``<think>`` and
``</think>`` added as Qwen3 adds them (added tokens, not special: the text
keeps them, so the gateway's reasoning parser sees them), and a ChatML
template. A random model would never close a thinking section, so the weights
are built to: every layer's output projections are zero (the residual stream
is the current token's embedding), so the next token is a function of the
current one alone, and the LM head holds a chain, from the prompt's last
token (the template opens ``<think>``): "Let me think" ``</think>`` then
" Sure" (a word no JSON grammar allows); every other token gets a lower
logit, highest for the tokens of ``ANSWER`` and EOS. So the model's own greedy continuation is
thought, end of thought, " Sure"; only a grammar in force after ``</think>``
turns " Sure" into JSON, and only a grammar deferred until then lets the
thought through.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer
from transformers import AutoModelForCausalLM, Qwen3Config

THINK, END_THINK = "<think>", "</think>"
THOUGHT = "Let me think"
ANSWER = '{"answer": "yes"}'
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
# ChatML that opens the thinking section in the prompt unless enable_thinking
# is false (then it closes it at once), as Qwen3's thinking models do: smg
# reads the toggle from the template and sets require_reasoning when it is on.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
QUESTION = "Is this a test?"
CHAIN_LOGIT = 150.0  # the chain's next token: ~136 after the final norm
ANSWER_LOGIT = 14.0  # ANSWER's tokens and EOS: ~40 from any token


def prompt_text(question: str = QUESTION) -> str:
    """TEMPLATE's prompt, thinking on."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n"


def build(tokenizer_dir: Path, out: Path, *, seed: int = 29) -> dict[str, int]:
    """Write the checkpoint to ``out``; the token ids the chain uses."""
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)])
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    for name in ("special_tokens_map.json", "generation_config.json"):
        (out / name).write_bytes((tokenizer_dir / name).read_bytes())

    def one(text: str) -> int:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, (text, ids)
        return ids[0]

    eos = one("<|im_end|>")
    last = tok.encode(prompt_text(), add_special_tokens=False).ids[-1]
    thought = tok.encode(THOUGHT, add_special_tokens=False).ids
    chain = [last, *thought, one(END_THINK), one(" Sure")]
    assert len(set(chain)) == len(chain), chain
    answer = [*tok.encode(ANSWER, add_special_tokens=False).ids, eos]
    assert not set(answer) & set(chain), (answer, chain)

    vocab = tok.get_vocab_size()
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=one("<|im_start|>"),
        eos_token_id=eos,
        pad_token_id=None,
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.randn(vocab, cfg.hidden_size)
        emb[:, 0] = 3.0  # a direction every token shares: the answer's bonus reads it
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.randn(vocab, cfg.hidden_size) * 0.01
        for a, b in itertools.pairwise(chain):
            u = emb[a].clone()
            u[0] = 0.0
            head[b] += CHAIN_LOGIT * u / u.dot(u)
        for t in answer:
            head[t, 0] += ANSWER_LOGIT
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out)
    return {"eos": eos, "end_think": chain[-2], "sure": chain[-1]}
