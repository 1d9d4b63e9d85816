"""One definition of the output columns (pipelines/job/columns.py): the shard schema, the output
row, the names a keep_column may not take, the manifest's per-shard sums and totals, and the
columns `report` reads all come from it."""

import pipelines.io.checkpoint as checkpoint
import pipelines.io.records as records
import pipelines.io.columns as columns
import pipelines.io.sink as sink
import pipelines.job.columns as table
from mtplx.request import Result, RowStats
from pipelines.io.rows import Item


def test_every_place_reads_the_one_list(tmp_path, monkeypatch):
    names = [c.name for c in table.COLUMNS]
    assert list(table.OUTPUT_COLUMN_NAMES) == names == columns.output_schema().names
    assert set(table.REPORT_COLUMNS) <= set(names) and "completion" not in table.REPORT_COLUMNS
    stats = RowStats(prompt_tokens=3, completion_tokens=2, verify_calls=1, drafted_tokens=2, accepted_tokens=1)
    row = columns.output_row(Item(0, "a", [1, 2, 3]), 0, 7, Result("k", [4, 5], "xy", "length", stats=stats))
    assert list(row) == [n for n in names if n in row] and set(row) == set(names)

    # a new summed column reaches the shard entries and the totals with no other change
    extra = table.Column("extra_stat", "int64", summed=True)
    monkeypatch.setattr(columns, "COLUMNS", table.COLUMNS + (extra,))
    monkeypatch.setattr(sink, "SUMMED_COLUMNS", table.SUMMED_COLUMNS + ("extra_stat",))
    monkeypatch.setattr(records, "SUMMED_COLUMNS", table.SUMMED_COLUMNS + ("extra_stat",))
    run = checkpoint.RunDir.prepare(str(tmp_path / "run"), "name: x\n", {"p": "1"}, log=lambda m: None)
    w = sink.ShardWriter(run, columns.output_schema(), 2)
    for i in range(2):
        w.add({**dict.fromkeys(names + ["extra_stat"]), "row": i, "sample": 0, "id": str(i), "finish_reason": "stop", "extra_stat": 5})
    w.flush()
    manifest = records.read_manifest(str(tmp_path / "run"))
    assert manifest["shards"][0]["extra_stat"] == 10
    assert records.totals(manifest)["extra_stat"] == 10
    run.close()
