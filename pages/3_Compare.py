"""Compare: 2-4 runs side by side (FP32 versus mixed, opt levels, scales), each in a fixed colour."""

import pandas as pd
import streamlit as st

from mpdiag.analysis import summaries
from mpdiag.analysis.compare import DIVERGENCE_RTOL, first_divergence, loss_comparison, reference_run
from mpdiag.dashboard import charts
from mpdiag.dashboard import frame as ui

CONFIG_FIELDS = ["opt_level", "scaling", "init_scale", "loss_scale", "growth_factor", "backoff_factor",
                 "growth_interval", "min_scale", "max_scale", "seed", "steps", "every", "device", "gpu_name",
                 "torch_version", "script_sha256", "batch_size", "params", "status"]


def default_selection(runs: pd.DataFrame) -> list[int]:
    """The newest run with its FP32 reference; else with the newest other run of the same script; else the
    two newest runs."""
    newest = runs.iloc[0]
    ref = reference_run(runs, int(newest["run_id"]))
    if ref is not None:
        return [int(newest["run_id"]), ref]
    same = runs[(runs["script_sha256"] == newest["script_sha256"]) & (runs["run_id"] != newest["run_id"])]
    if len(same):
        return [int(newest["run_id"]), int(same["run_id"].iloc[0])]
    return runs["run_id"].head(2).astype(int).tolist()


def steps_of(store, run: pd.Series, label: str) -> pd.DataFrame:
    final = run["status"] in ui.FINAL_STATUSES
    steps = ui.read(store, "steps", int(run["run_id"]), final=final)
    return summaries.thin_steps(steps).assign(run=label)


def compare_view(store, chosen: pd.DataFrame, all_runs: pd.DataFrame) -> None:
    labels = [ui.run_label(r) for _, r in chosen.iterrows()]
    steps = {lab: steps_of(store, r, lab) for lab, (_, r) in zip(labels, chosen.iterrows(), strict=True)}
    everything = pd.concat(steps.values(), ignore_index=True)

    st.altair_chart(charts.runs_overlay(everything, "loss", "loss", labels), width="stretch")
    selected = chosen["run_id"].astype(int).tolist()
    diffs, notes, firsts = [], [], []
    for lab, (_, r) in zip(labels, chosen.iterrows(), strict=True):
        ref_id = reference_run(all_runs, int(r["run_id"]), prefer=selected)
        if ref_id is None:
            if r["opt_level"] != "O0":
                notes.append(f"**{lab}**: no finished FP32 (O0) run of the same script and seed to compare with "
                             "(start runs with 'Also run an FP32 twin').")
            continue
        ref = all_runs[all_runs["run_id"] == ref_id].iloc[0]
        ref_steps = ui.read(store, "steps", ref_id, final=True)
        comparison = loss_comparison(ref_steps, steps[lab]).assign(run=lab)
        step = first_divergence(comparison)
        firsts.append(step)
        where = f"stays within {DIVERGENCE_RTOL:.0%}" if step is None else f"first differs by more than {DIVERGENCE_RTOL:.0%} (or turns non-finite) at step {step}"
        notes.append(f"**{lab}** versus its FP32 reference {ui.run_label(ref)}: {where}.")
        diffs.append(comparison)
    if diffs:
        first = min((s for s in firsts if s is not None), default=None)
        st.altair_chart(charts.loss_difference(pd.concat(diffs), first, labels), width="stretch")
    st.markdown("  \n".join(notes))

    left, right = st.columns(2)
    left.altair_chart(charts.runs_overlay(everything, "loss_scale", "loss scale", labels, log=True), width="stretch")
    right.altair_chart(charts.runs_overlay(everything, "step_time_s", "step time (s)", labels), width="stretch")
    st.altair_chart(charts.runs_overlay(everything.assign(peak_mem_mb=everything["peak_mem_bytes"] / 2**20),
                                        "peak_mem_mb", "peak memory so far (MB)", labels), width="stretch")
    cost = pd.DataFrame({
        "run": labels,
        "median step ms": (chosen["median_step_time_s"] * 1e3).round(2).to_numpy(),
        "samples/s": (chosen["batch_size"] / chosen["median_step_time_s"]).round(1).to_numpy(),
        "peak memory MB": (chosen["peak_mem_bytes"] / 2**20).round(1).to_numpy(),
        "model state MB": [round(sum(v for k, v in s.items() if k != "params") / 2**20, 3) if s else None
                           for s in chosen["model_state"]],
        "skipped steps": chosen["skipped_steps"].to_numpy(),
        "final loss": chosen["final_loss"].to_numpy(),
    })
    st.dataframe(cost, hide_index=True, width="stretch")
    st.caption("Peak memory is the CUDA allocator's peak on a GPU and the process's peak RSS on a CPU; model state "
               "is the bytes allocated for weights, gradients, master weights and optimizer state.")

    st.subheader("FP16 shares per tensor (gradient at the loss scale, all logged steps)")
    shares = []
    for lab, (_, r) in zip(labels, chosen.iterrows(), strict=True):
        totals = ui.read(store, "tensor_totals", int(r["run_id"]), final=r["status"] in ui.FINAL_STATUSES)
        if len(totals):
            shares.append(summaries.tensor_ranking(totals, "fp16", at_scale=True).assign(run=lab))
    if shares:
        table = pd.concat(shares, ignore_index=True)
        worst = table.groupby("tensor")["underflow_share"].max().nlargest(12).index
        top = table[table["tensor"].isin(worst)]
        st.altair_chart(charts.runs_bars(top, "tensor", "underflow_share", "FP16 underflow share", labels), width="stretch")
        st.altair_chart(charts.runs_bars(top, "tensor", "overflow_share", "FP16 overflow share", labels), width="stretch")
    else:
        st.info("None of these runs has gradient statistics yet.")

    st.subheader("Configuration")
    config = chosen.set_index(pd.Index(labels))[CONFIG_FIELDS].T.astype(str)
    differs = config.nunique(axis=1) > 1
    only_diff = st.checkbox("Only settings that differ", value=True, key="only_diff")
    st.dataframe(config[differs] if only_diff else config, width="stretch")


store = ui.frame("Compare")
if store is None:
    st.stop()
runs = store.runs()
if len(runs) < 2:
    st.info("Comparing needs at least two runs. Start runs on the Runs page (tick 'Also run an FP32 twin').")
    st.stop()
selected = ui.pick_runs(runs, default=default_selection(runs), label="Runs to compare (2 to 4, colours fixed by order)")
if len(selected) < 2:
    st.info("Choose at least two runs.")
    st.stop()
chosen = runs.set_index("run_id").loc[selected].reset_index()
live = not chosen["status"].isin(ui.FINAL_STATUSES).all()
st.fragment(compare_view, run_every=ui.LIVE_REFRESH_S if live else None)(store, chosen, runs)
