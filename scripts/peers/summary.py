"""The summary both peer clients print: the fields of `examples/replay --json` that apply."""


def percentile(values, p):
    v = sorted(values)
    return v[min(len(v) - 1, round(p / 100 * (len(v) - 1)))]


def summarize(records, wall, **extra):
    """`records`: one dict per turn with `turn` (index), `ttft` and `latency` (s), `output`."""
    ttft = [r["ttft"] * 1e3 for r in records]
    norm = [r["latency"] * 1e3 / max(1, r["output"]) for r in records]
    late = [r["ttft"] * 1e3 for r in records if r["turn"] >= 3]
    later = [r["ttft"] * 1e3 for r in records if r["turn"] >= 1] or [0.0]
    return {
        **extra,
        "turns": len(records),
        "wall_s": wall,
        "output_tok_per_s": sum(r["output"] for r in records) / wall,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p90": percentile(ttft, 90),
        "norm_latency_ms_p90": percentile(norm, 90),
        "ttft_ms_turns_4_plus_mean": sum(late) / max(1, len(late)),
        "ttft_ms_turns_2_plus_p50": percentile(later, 50),
        "ttft_ms_turns_2_plus_p90": percentile(later, 90),
    }
