"""On the GPU host: does mtplx/kernels/kernel_cache.py write the cache entries MLX's CUDA backend reads?

    python -m benchmarks.kernel_cache_check [--job jobs/eval-mtp.yaml] [--rows 8] [--attr M.N=V]

Runs the job's first rows through the engine once (every custom-kernel instantiation the job
meets: rows_attention, layer_kernels, ... at the job's shapes), timed, then for each instantiation
prints whether MLX's own generated source (its `verbose` print) equals `generated_source`'s (so the
entry's name is the one MLX looks up), whether the entry is in MLX's cache, and the kernel cache's
counts for the process (found / built here, with seconds / left to MLX, and why). Run it twice in
fresh processes: the second should find every entry and its run should not pay the builds. Then change
an entry's bytes (`truncate -s 100` one .ptx in the cache directory it prints): the next process builds
that one again.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import tempfile
import time

import mlx.core as mx
import yaml

from mtplx.kernels import kernel_cache as kc


def _instantiations():
    """Record every distinct instantiation the kernels are called with (kernel, arrays, dtypes, template)."""
    seen = {}
    call = kc.CachedKernel.__call__

    def recording(self, *, inputs, output_dtypes, template=(), **kwargs):
        arrays = tuple((a.dtype, a.ndim) for a in inputs)
        key = (id(self), arrays, tuple(output_dtypes), tuple(template))
        seen.setdefault(key, (self, arrays, list(output_dtypes), list(template)))
        return call(self, inputs=inputs, output_dtypes=output_dtypes, template=template, **kwargs)

    kc.CachedKernel.__call__ = recording
    return seen


def mlx_source(kernel, arrays, output_dtypes, template) -> str:
    """The source MLX generates for this instantiation (its verbose print, captured at file descriptor 1;
    the call only builds the graph, nothing runs)."""
    if kernel._mlx is None:
        kernel._mlx = mx.fast.cuda_kernel(name=kernel.name, input_names=kernel.input_names,
                                          output_names=kernel.output_names, source=kernel.source,
                                          header=kernel.header, **kernel._options)
    with tempfile.TemporaryFile() as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            kernel._mlx(inputs=[mx.zeros((1,) * n, d) for d, n in arrays], template=template, grid=(1, 1, 1),
                        threadgroup=(1, 1, 1), output_shapes=[(1,)] * len(output_dtypes), output_dtypes=output_dtypes,
                        verbose=True)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        text = f.read().decode(errors="replace")
    body = text.split("```\n", 1)[1] if "```\n" in text else text
    return body.rsplit("\n```", 1)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", default="jobs/eval-mtp.yaml")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--attr", action="append", default=[], help="MODULE.NAME=V, set first")
    args = ap.parse_args()
    for a in args.attr:
        target, value = a.split("=", 1)
        module, name = target.rsplit(".", 1)
        setattr(importlib.import_module(module), name, yaml.safe_load(value))
    from pipelines.execution.session import run_job
    from pipelines.job.config import load_job

    off = kc.prepare_cache_dir()  # before MLX builds a kernel
    seen = _instantiations()
    print(f"device {mx.default_device()}, MLX {mx.__version__}, MLX's cache {os.environ['MLX_PTX_CACHE_DIR']}, "
          f"our entries {off or 'on'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        job = load_job(args.job, [f"input.limit={args.rows}", f"output.dir={tmp}/run", "output.keep_columns=[]"])
        t0 = time.perf_counter()
        summary = run_job(job, restart=True)
        print(f"run: {time.perf_counter() - t0:.2f} s ({summary.completion_tokens} tokens, incl. load)", flush=True)
    same = 0
    for kernel, arrays, dtypes, template in seen.values():
        func, ours = kc.generated_source(kernel.name, kernel.input_names, kernel.output_names, kernel.source,
                                         kernel.header, arrays, dtypes, template)
        theirs = mlx_source(kernel, arrays, dtypes, template)
        entry = kc.entry_path(kc.private_dir, kc.entry_name(func, ours)) if kc.private_dir else None
        same += ours == theirs
        trusted = bool(entry) and kc.trusted(kc.private_dir, kc.record_key(ours), entry)
        print(f"  {func}: source as MLX's {ours == theirs}, our entry in MLX's cache {trusted}", flush=True)
        if ours != theirs:
            print("".join(list(difflib.unified_diff(theirs.splitlines(True), ours.splitlines(True), "mlx", "ours"))[:30]))
    print(f"instantiations {len(seen)}, sources as MLX's {same}; kernel cache: {kc.stats}", flush=True)


if __name__ == "__main__":
    main()
