"""The plan front end: YAML text to torch ``ParallelStyle``s for concrete module names.

source (YAML with line/column marks) -> schema -> plan (typed rules) -> resolve (globs ->
module names, ``globs``) -> lower (``{fqn: ParallelStyle}``); ``styles`` is the vocabulary.
Runs on a laptop: nothing here touches a process group or imports the runtime.
"""
