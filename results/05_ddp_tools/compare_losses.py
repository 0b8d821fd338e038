import csv
one, two = (list(csv.DictReader(open(f"/tmp/{r}/log.csv"))) for r in ("one", "two"))
print(f"{'step':>4}  {'key':<9} {'one GPU':>9}  {'two GPUs':>9}  rel. diff")
worst = 0.0
for a, b in zip(one, two):
    for k in ("loss", "val_loss"):
        if a[k]:
            x, y = float(a[k]), float(b[k]); d = abs(x - y) / abs(x); worst = max(worst, d)
            print(f"{a['step']:>4}  {k:<9} {x:9.5f}  {y:9.5f}  {d:.2e}")
print(f"max relative difference: {worst:.2e}")
