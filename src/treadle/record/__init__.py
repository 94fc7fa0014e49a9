"""The run record: what a run leaves in its folder, and who may write there. One layer, below the loop that writes
it (docs/architecture.md):

- ``record.runfiles``: THE run folder's files (metrics.jsonl, completions.jsonl, training_args.json, run.json), the
  entries of its log files and their one cut-line policy;
- ``record.fingerprints``: a checkpoint's marker file (the digests of its files) and the fingerprint of the settings
  that shape a run;
- ``record.plots``: the PNG plots of a run's metrics;
- ``record.runs``: a run folder belongs to one run: its checks, the lock (the operating system's, through
  ``filelock``), ``overwrite_output_dir``;
- ``record.disk``: a disk that fills up, turns read-only or reaches a size limit mid-run, as one line;
- ``record.commands``: the folders of ``treadle demo`` and ``treadle merge``.

What reads the trainer (``treadle.describe``: run.json's contents), the trackers (``treadle.trackers``) and the
report (``treadle.cli.report``) live beside the loop and on the run side.
"""
