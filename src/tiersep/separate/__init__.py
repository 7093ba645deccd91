"""`tiersep separate`: separate your own songs with a trained tier, memory-bounded and streamed.

audio.py   find songs, probe them, decode (ffmpeg pipe) and encode (soundfile, ffmpeg) in blocks
resample.py  block-by-block resampling, the same numbers as prepare's whole-track resampling
plan.py    the device, the budget, and the chunk and batch that fit it (memory/inference.py)
overlap_add.py  the chunked overlap-add engine (OverlapAdd, ShiftAverage); evaluate uses it too
song.py    one song through decode -> resample -> OverlapAdd -> resample back -> stem files
stems.py   the stem files of one song: temporaries, clipping, renamed together
options.py the command's options and the checks before any work (torch-free: the CLI runs them first)
run.py     the command: the plan, the loop over songs, the JSON sidecars
"""
