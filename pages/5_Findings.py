"""Findings: what is wrong with a run, where, what to change, and a rerun that checks the fix."""

from urllib.parse import urlencode

import pandas as pd
import streamlit as st

from mpdiag.analysis.compare import reference_run
from mpdiag.analysis.findings import GRADIENT_REL_ERROR, diagnose, finding_resolved
from mpdiag.analysis.summaries import shadow_ranking, update_shares
from mpdiag.dashboard import charts
from mpdiag.dashboard import frame as ui
from mpdiag.sandbox.launch import launch, rerun_job
from mpdiag.sandbox.probe import KIND as PROBE_KIND
from mpdiag.sandbox.probe import run_probe

BADGES = {"error": "Error", "warning": "Warning", "info": "Note"}
#: anchors of this page's evidence sections, for findings whose evidence is shown here
SECTIONS = {"gradient-error": "shadow", "update-swamping": "updates", "masters-needed": "updates"}


def start_fix(store, run: pd.Series, finding) -> None:
    """Rerun with the finding's fix; with an FP32 twin when no FP32 reference exists to judge the loss."""
    runs = store.runs()
    options = dict(finding.fix, pair=reference_run(runs, int(run["run_id"])) is None and finding.fix.get("opt_level") != "O0")
    proc = launch(rerun_job(int(run["run_id"]), options), store.path)
    st.session_state.setdefault("launched", []).append((proc, f"fix of {finding.rule} on #{run['run_id']}"))
    st.toast(f"Rerunning #{run['run_id']} with {finding.fix}")


def reruns_table(store, run: pd.Series, findings) -> None:
    """Reruns of this run: did each finding go away, and how does the loss compare to FP32?"""
    runs = store.runs()
    children = runs[(runs["parent_run_id"] == run["run_id"]) & (runs["opt_level"] != "O0")]
    if children.empty:
        return
    st.subheader("Reruns of this run")
    rows = []
    for _, child in children.iterrows():
        row = {"run": ui.run_label(child), "status": child["status"], "final loss": child["final_loss"]}
        if child["status"] == "finished":
            after = diagnose(store, int(child["run_id"]))
            for f in findings:
                row[f.rule] = "gone" if finding_resolved(f, after) else "still there"
            ref = reference_run(runs, int(child["run_id"]))
            if ref is not None:
                ref_loss = float(runs.loc[runs["run_id"] == ref, "final_loss"].iloc[0])
                row["FP32 final loss"] = ref_loss
                row["vs FP32"] = f"{(child['final_loss'] - ref_loss) / abs(ref_loss):+.1%}" if ref_loss else "n/a"
        rows.append(row)
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")


def shadow_section(store, run_id: int, final: bool) -> None:
    """Gradients against the FP32 shadow (--shadow-every), tensors ranked by lost precision."""
    shadow = ui.read(store, "shadow_stats", run_id, final=final)
    if shadow.empty:
        st.caption("No FP32 shadow for this run: rerun with --shadow-every N (the run form's "
                   "'FP32 shadow every') to rank tensors by the precision their gradients lose.")
        return
    ranking = shadow_ranking(shadow)
    st.dataframe(ranking.rename(columns={"meaningful": "reference not negligible"}), hide_index=True, width="stretch",
                 column_config={"median_rel_error": st.column_config.NumberColumn(format="%.3g"),
                                "max_rel_error": st.column_config.NumberColumn(format="%.3g"),
                                "min_cosine": st.column_config.NumberColumn(format="%.5f")})
    top = ranking[ranking["meaningful"]]["tensor"].head(5).tolist()
    st.altair_chart(charts.shadow_error_lines(shadow, top, GRADIENT_REL_ERROR), width="stretch")


def updates_section(store, run: pd.Series, final: bool) -> None:
    """Optimizer updates against the weight format's resolution (recorded at O2, O3 and bf16-pure)."""
    updates = ui.read(store, "update_stats", int(run["run_id"]), final=final)
    if updates.empty:
        st.caption("Updates are checked against FP16/BF16 resolution at O2, O3 and bf16-pure; "
                   "this run has no such record.")
        return
    per_tensor, per_step = update_shares(updates)
    st.altair_chart(charts.update_share_lines(per_step, run["update_format"]), width="stretch")
    st.dataframe(per_tensor, hide_index=True, width="stretch",
                 column_config={c: st.column_config.NumberColumn(format="percent")
                                for c in ("below_resolution_share", "unchanged_share")})


def findings_view(store, run: pd.Series, final: bool) -> None:
    run_id = int(run["run_id"])
    if final and run["scaling"] != "none" and run["config"].get("run") and store.probe(run_id, PROBE_KIND) is None:
        with st.spinner("Probing: recomputing one batch at two loss scales in a child process…"):
            run_probe(store.path, run_id)
    findings = diagnose(store, run_id)
    if not final:
        st.info("The run is still going: these findings cover the steps recorded so far.")
    if not findings:
        st.success(f"No findings for {ui.run_label(run)}: none of the rules in the README fired.")
    for i, f in enumerate(findings):
        with st.container(border=True):
            st.markdown(f"**{BADGES[f.severity]} · {f.title}**  \n`{f.rule}`")
            st.markdown(f"**Evidence.** {f.evidence}")
            if f.tensors:
                st.caption("Tensors: " + ", ".join(f.tensors[:12]) + (" …" if len(f.tensors) > 12 else ""))
            st.markdown(f"**What to change.** {f.recommendation}")
            cols = st.columns(2)
            query = {"run": run_id} if f.page != "Compare" else {"runs": run_id}
            if f.page == "Gradients" and f.tensors:
                query["tensor"] = f.tensors[0]
            if f.page == "Findings":
                cols[0].markdown(f"[See the evidence below](#{SECTIONS[f.rule]})")
            else:
                cols[0].markdown(f"[See the evidence on the {f.page.replace('_', ' ')} page](/{f.page}?{urlencode(query)})")
            if f.fix and final:
                fix_text = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in f.fix.items())
                if cols[1].button(f"Rerun with this fix ({fix_text})", key=f"fix_{run_id}_{i}"):
                    start_fix(store, run, f)
    reruns_table(store, run, findings)
    st.subheader("Gradients against the FP32 shadow", anchor=SECTIONS["gradient-error"])
    shadow_section(store, run_id, final)
    st.subheader("Optimizer updates against the weight format", anchor=SECTIONS["update-swamping"])
    updates_section(store, run, final)


ui.single_run_page("Findings", findings_view)
