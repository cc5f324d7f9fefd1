"""Building the demo target end to end: tokenizer, model, pre-training, a verified save.

Owns: the order of the build and what the target directory holds -
tokenizer files with the chat template, `config.json` + `model.safetensors` +
`generation_config.json`, `build_report.json` and `loss_curve.png`. The folder
is assembled beside `out_dir` and renamed into place only once the saved model
has been loaded back and gives the same logits, so a crashed build never
leaves a half-written target.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from eagle3_dagster.chat import kimi
from eagle3_dagster.config import TinyTargetConfig
from eagle3_dagster.data.sharegpt import ShareGPTReader
from eagle3_dagster.io import atomic_write_json
from eagle3_dagster.target import target_identity
from eagle3_dagster.tiny.model import count_parameters, create_tiny_model, tiny_model_config
from eagle3_dagster.tiny.pretrain import PretrainSettings, pack_sequences, pretrain
from eagle3_dagster.tiny.tokenizer import conversation_texts, save_tokenizer, train_tokenizer

# A conversation contributes at most this many sequences' worth of tokens, so the
# budget covers many conversation openings (what the demo later prompts with).
MAX_SEQS_PER_CONVERSATION = 2


@dataclass
class TinyTargetReport:
    num_parameters: int
    tokens_seen: int
    final_loss: float
    loss_curve: list[float]
    build_seconds: float
    tokenizer_vocab_size: int
    identity: str


def build_tiny_target(
    cfg: TinyTargetConfig, out_dir: Path, *, progress: Callable[[str], None] | None = None
) -> TinyTargetReport:
    """Build the tiny target into `out_dir` (replacing what is there) and return its report."""
    say = progress or (lambda _msg: None)
    started = time.monotonic()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = out_dir.parent / f".{out_dir.name}.building-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        report = _build_into(cfg, work, say, started)
        _replace_dir(work, out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    say(f"tiny target ready at {out_dir} ({report.num_parameters:,} parameters, loss {report.final_loss:.3f})")
    return report


def _build_into(cfg: TinyTargetConfig, work: Path, say: Callable[[str], None], started: float) -> TinyTargetReport:
    # The BPE sees the first conversations of the train split; held-out ones never reach the target.
    bpe_reader = ShareGPTReader(split="train", limit=cfg.tokenizer_train_conversations)
    bpe_conversations = list(bpe_reader)
    say(f"training BPE tokenizer (vocab {cfg.vocab_size}) on {len(bpe_conversations)} ShareGPT conversations")
    tokenizer = train_tokenizer(conversation_texts(bpe_conversations), cfg.vocab_size)
    if len(tokenizer) > cfg.vocab_size:
        raise AssertionError(
            f"tokenizer has {len(tokenizer)} entries, more than target.tiny.vocab_size {cfg.vocab_size}"
        )
    save_tokenizer(tokenizer, work)

    settings = PretrainSettings(
        num_tokens=cfg.pretrain_tokens,
        seq_len=cfg.pretrain_seq_len,
        batch_size=cfg.pretrain_batch_size,
        lr=cfg.pretrain_lr,
        seed=cfg.seed,
    )
    streams, data_reader = _pretrain_streams(tokenizer, settings, cfg.pretrain_answer_words)
    say(
        f"rendered {len(streams)} conversations ({sum(map(len, streams)):,} tokens) for {settings.num_steps} pretrain steps"
    )
    sequences_NT = pack_sequences(streams, settings.seq_len, settings.num_steps * settings.batch_size)

    stop_ids = kimi.stop_token_ids(tokenizer)
    config = tiny_model_config(
        cfg,
        vocab_size=cfg.vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stop_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = create_tiny_model(config, cfg.seed)
    result = pretrain(model, sequences_NT, settings, progress=say)

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stop_ids,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    # config.json carries a digest of the weights, so the target's identity (config + weight
    # layout, see eagle3_dagster.target) changes when a rebuild changes the weights.
    model.config.weights_sha256 = weights_digest(model)
    model.save_pretrained(str(work))
    _check_reload(model, work, sequences_NT[:2, :32])
    _plot_loss(result.step_losses, work / "loss_curve.png")

    report = TinyTargetReport(
        num_parameters=count_parameters(model),
        tokens_seen=result.tokens_seen,
        final_loss=result.final_loss,
        loss_curve=result.loss_curve,
        build_seconds=time.monotonic() - started,
        tokenizer_vocab_size=len(tokenizer),
        identity=target_identity(work),
    )
    atomic_write_json(
        work / "build_report.json",
        {
            **asdict(report),
            "num_steps": result.num_steps,
            "pretrain_seconds": result.seconds,
            "expert_load_imbalance": result.expert_load_imbalance,
            "tiny_config": cfg.model_dump(),
            "sharegpt_bpe": asdict(bpe_reader.stats),
            "sharegpt_pretrain": asdict(data_reader.stats),
            "torch_threads": torch.get_num_threads(),
        },
    )
    return report


def _pretrain_streams(
    tokenizer, settings: PretrainSettings, answer_words: int | None = None
) -> tuple[list[list[int]], ShareGPTReader]:
    """Chat-rendered train-split conversations, read until they cover the token budget."""
    cap = MAX_SEQS_PER_CONVERSATION * settings.seq_len
    reader = ShareGPTReader(split="train")
    streams: list[list[int]] = []
    total = 0
    for batch in _batched(reader, 64):
        texts = [tokenizer.apply_chat_template(_clip_answers(c.messages, answer_words), tokenize=False) for c in batch]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            streams.append(ids[:cap])
            total += len(streams[-1])
        if total >= settings.num_tokens:
            break
    return streams, reader


def _clip_answers(messages, words: int | None) -> list[dict]:
    """ShareGPT answers run to hundreds of tokens; a tiny target pre-trained on their openings alone
    would never see a turn end and every regenerated answer would be cut off by length."""
    if words is None:
        return list(messages)
    pattern = re.compile(r"\s*(?:\S+\s+){0,%d}\S+" % (words - 1))
    out = []
    for m in messages:
        if m["role"] == "assistant":
            match = pattern.match(m["content"])
            m = {**m, "content": match.group(0).strip() if match else m["content"]}
        out.append(m)
    return out


@torch.no_grad()
def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode() + b"\0" + str(tuple(tensor.shape)).encode() + str(tensor.dtype).encode())
        h.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _batched(iterable, n: int):
    it = iter(iterable)
    while chunk := list(itertools.islice(it, n)):
        yield chunk


@torch.no_grad()
def _check_reload(model: torch.nn.Module, model_dir: Path, sample_BT: torch.Tensor) -> None:
    """The saved files must reproduce the trained model exactly; also proves AutoTokenizer/AutoModel load them."""
    AutoTokenizer.from_pretrained(str(model_dir))
    reloaded = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    reloaded.eval()
    if not torch.equal(model(sample_BT).logits, reloaded(sample_BT).logits):
        raise AssertionError(f"{model_dir}: reloaded model gives different logits from the trained one")


def _plot_loss(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_title("tiny target pre-training")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; an existing `dst` is moved aside first and removed after."""
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
