"""Users' own training loops as source text, for tests that record them as a user would (watch, the Recorder,
an upload), each with how to read the truth it writes about itself."""

HALF_LOOP = """
import json, sys
import torch

torch.manual_seed(0)
# a loop that keeps its model in FP16 itself (pure FP16 training, as O3 does), with AdamW's default eps=1e-8
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).half()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 8).half(), torch.randn(32, 1).half()
truth = []  # what the loop sees itself: finite before each step, which parameters are non-finite after it
for step in range(3):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
    loss.backward()
    before = bool(torch.isfinite(loss)) and all(
        bool(torch.isfinite(p.grad).all()) and bool(torch.isfinite(p).all()) for p in model.parameters())
    optimizer.step()
    truth.append({"finite_before": before,
                  "broken": [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]})
json.dump(truth, open(sys.argv[1], "w"))
"""


def first_broken_step(truth: list[dict]) -> tuple[int, list[str]]:
    """The loop's own account: the first step that started finite and ended with non-finite weights."""
    return next((i, t["broken"]) for i, t in enumerate(truth) if t["finite_before"] and t["broken"])
