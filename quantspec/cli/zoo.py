"""`quantspec zoo`: the model zoo's recipes (training draft modules for a frozen base)."""

from __future__ import annotations

import click

from quantspec.cli.group import main, one_line_errors, threads_option


@main.group()
def zoo():
    """Model-zoo recipes (training the MTP module and draft heads)."""


@zoo.command(name="train-mtp")
@click.option("--model", default="smollm2-135m", show_default=True, help="The frozen base model.")
@click.option("--dataset", default=None, help="Text data: local .txt/.json/.jsonl/.parquet or a hub id.")
@click.option("--split", default="train", show_default=True)
@click.option("--text-field", default="text", show_default=True, help="Dataset column holding the text.")
@click.option("--steps", default=1500, show_default=True, type=int)
@click.option("--seq-len", default=256, show_default=True, type=int, help="Dataset window length (tokens).")
@click.option("--batch-size", default=4, show_default=True, type=int,
              help="Windows' worth of positions per step (eagle3: sequences per step).")
@click.option("--num-samples", default=16, show_default=True, type=int, help="Dataset windows used.")
@click.option("--lr", default=1e-3, show_default=True, type=float)
@click.option("--self-distill/--no-self-distill", default=True, show_default=True,
              help="Train on the base's own greedy choices and its answers to built-in chat prompts.")
@click.option("--targets", type=click.Choice(["hard", "soft"]), default="hard", show_default=True,
              help="hard: one token per position (the base's argmax with --self-distill, else the "
                   "dataset's next token); soft: the base's distribution over the draft vocabulary "
                   "(with --self-distill; better on few prompts, on par with hard on all 1618).")
@click.option("--chat-prompts", default=None, type=click.IntRange(min=1),
              help="How many of the built-in chat prompts the base answers for self-distillation [default: all].")
@click.option("--max-new-tokens", default=160, show_default=True, type=int, help="Length of each self-distilled answer.")
@click.option("--draft-vocab-size", default=4096, show_default=True, type=int,
              help="Tokens the draft head scores (the most frequent targets).")
@click.option("--save-every", default=250, show_default=True, type=int, help="Checkpoint interval (steps).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="MTP artifact directory.")
@click.option("--resume", is_flag=True, help="Continue the checkpoint in --out (same data and --targets; "
                                              "--steps may grow); an interrupted run's prepared data is reused.")
@one_line_errors
@threads_option
def train_mtp(**kw):
    """Train a DeepSeek-V3-style MTP module for a frozen base (use with --speculate-method mtp)."""
    from quantspec import api
    from quantspec.console import Progress

    with Progress("train-mtp") as progress:
        res = api.train_mtp(on_step=lambda step, total, loss: progress.fraction(step, total, f"loss {loss:.3f}"),
                            on_status=progress.status, **kw)
    console = progress.console
    if res["start_step"] >= res["steps"] and res["positions"] is None:
        console.print(f"{res['out']} is already trained to {res['start_step']} steps (--steps {res['steps']}): "
                      "nothing to do; pass a larger --steps to continue it", soft_wrap=True)
        return
    first = "-" if res["loss_first"] is None else f"{res['loss_first']:.3f}"
    last = "-" if res["loss_last"] is None else f"{res['loss_last']:.3f}"
    console.print(f"[green]wrote[/] {res['out']}  (steps {res['start_step']}→{res['steps']}, loss {first} → {last}, "
                  f"{res['positions']} positions, {res['wall_s']:.0f} s)")


@zoo.command(name="train-draft-head")
@click.option("--kind", type=click.Choice(["medusa", "eagle3"]), default="medusa", show_default=True,
              help="medusa: heads in the Medusa authors' layout (--speculate-method medusa); eagle3: an EAGLE-3 "
                   "head in the layout vLLM / SGLang load (--speculate-method eagle).")
@click.option("--model", default="smollm2-135m", show_default=True, help="The frozen base model.")
@click.option("--num-heads", default=4, show_default=True, type=int, help="medusa: heads.")
@click.option("--aux-layer-ids", default=None, help="eagle3: the base's low,mid,high layers read "
              "[default: 2,L/2,L-3].", callback=lambda _c, _p, v: v and [int(x) for x in v.split(",")])
@click.option("--ttt-steps", default=4, show_default=True, type=int,
              help="eagle3: training-time-test depth (the head unrolled on its own outputs).")
@click.option("--targets", type=click.Choice(["hard", "soft"]), default=None,
              help="eagle3: soft (default): the forward KL from the base's distribution over the draft "
                   "vocabulary, as EAGLE-3 trains; hard: the cross-entropy against its argmax. medusa: hard.")
@click.option("--num-layers", default=1, show_default=True, type=int, help="ResBlocks per head.")
@click.option("--dataset", default=None, help="Text data besides the self-distilled chat answers.")
@click.option("--steps", default=None, type=int, help="[default: medusa 300, eagle3 900]")
@click.option("--batch-size", default=4, show_default=True, type=int,
              help="Windows' worth of positions per step (eagle3: sequences per step).")
@click.option("--seq-len", default=256, show_default=True, type=int)
@click.option("--lr", default=1e-3, show_default=True, type=float)
@click.option("--chat-prompts", default=None, type=click.IntRange(min=1),
              help="How many of the built-in chat prompts the base answers [default: medusa all, eagle3 512].")
@click.option("--max-new-tokens", default=160, show_default=True, type=int, help="Length of each self-distilled answer.")
@click.option("--draft-vocab-size", default=4096, show_default=True, type=int,
              help="Tokens the heads score when drafting (the most frequent targets).")
@click.option("--save-every", default=100, show_default=True, type=int, help="Checkpoint interval (steps).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Head artifact directory.")
@click.option("--resume", is_flag=True, help="Continue the checkpoint in --out (same data; --steps may grow).")
@one_line_errors
@threads_option
def train_draft_head(**kw):
    """Train draft heads for a frozen base by self-distillation (Medusa, EAGLE-3)."""
    from quantspec import api
    from quantspec.console import Progress

    def on_step(step, total, loss, accuracy=()):
        acc = " top-1 " + "/".join(f"{a:.2f}" for a in accuracy) if accuracy else ""
        progress.fraction(step, total, f"loss {loss:.3f}{acc}")

    kind, aux, ttt, targets = kw["kind"], kw.pop("aux_layer_ids"), kw.pop("ttt_steps"), kw.pop("targets")
    if kind == "eagle3":
        kw.pop("num_layers")
        kw.pop("num_heads")
        kw.update(aux_layer_ids=aux, ttt_steps=ttt, soft_targets=targets != "hard")
    elif targets == "soft":
        raise click.UsageError("--targets soft trains --kind eagle3; Medusa heads train on hard targets")
    with Progress(f"train-draft-head ({kind})") as progress:
        res = api.train_draft_head(on_step=on_step, on_status=progress.status, **kw)
    if res["positions"] is None:
        progress.console.print(f"{res['out']} is already trained to {res['start_step']} steps: nothing to do")
        return
    progress.console.print(f"[green]wrote[/] {res['out']}  (steps {res['start_step']}→{res['steps']}, loss "
                           f"{res['loss_first']:.3f} → {res['loss_last']:.3f}, {res['positions']} positions, "
                           f"{res['wall_s']:.0f} s)")


@zoo.command(name="rotate-head")
@click.option("--model", required=True, help="The unquantized EAGLE-3 head, trained on the base before it was rotated.")
@click.option("--base", required=True, help="The base artifact `quantize --rotate` wrote from that base.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Head artifact directory.")
@click.option("--overwrite", is_flag=True, help="replace a non-empty --out")
@one_line_errors
def rotate_head(model, base, out, overwrite):
    """Turn an EAGLE-3 head to read a base whose weights `quantize --rotate` rotated (the same drafts)."""
    from quantspec import api

    path = api.rotate_eagle3_head(model, base, out, overwrite=overwrite)
    click.echo(f"wrote {path}")

