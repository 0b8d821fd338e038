# Variants of 05's all-reduce step under torchrun (or one GPU): VARIANT=chunksN[:bucketMB] (env), then 05's main().
import functools, os, sys, importlib.util
sys.argv[0] = os.path.join(os.getcwd(), "05_train_roformer_mlm.py")
spec = importlib.util.spec_from_file_location("train05", sys.argv[0]); train = importlib.util.module_from_spec(spec)
sys.modules["train05"] = train; spec.loader.exec_module(train)
variant = os.environ.get("VARIANT", "chunks1")
chunks, _, mb = variant[6:].partition(":")
sys.path.insert(0, os.path.join(os.getcwd(), ".dev"))
if mb:
    init = train.AllReduceGradients.__init__
    train.AllReduceGradients.__init__ = lambda self, model: init(self, model, int(mb) * 2**20)
if int(chunks) > 1:
    import ddp_variants_chunks as dvc
    train.capture_cuda_graphs = functools.partial(dvc.capture_chunks, chunks=int(chunks))
if int(os.environ.get("RANK", 0)) == 0:
    print(f"# variant {variant}", flush=True)
train.main()
