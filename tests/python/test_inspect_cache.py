"""inspect's cache pre-filled for pseudo file names (fuselight.inspect_cache): primed on import, and
answer-preserving: no module is loaded from such a name, so inspect's own scan would find none."""

import inspect
import sys

from fuselight import inspect_cache


def test_primed_on_import_and_maps_to_no_module():
    for name in inspect_cache.PSEUDO_FILES:
        assert inspect.modulesbyfile[name] == inspect_cache.NO_MODULE
    assert sys.modules.get(inspect_cache.NO_MODULE) is None


def test_no_loaded_module_has_a_pseudo_file():
    import fuselight.compile  # noqa: F401 - the modules a build has loaded (TVM, numpy, ...)

    files = {getattr(m, "__file__", None) for m in list(sys.modules.values())}
    assert not files & set(inspect_cache.PSEUDO_FILES)


def test_a_frame_of_string_code_still_has_no_module_and_no_source():
    namespace: dict = {}
    exec(compile("import inspect\nframe = inspect.currentframe()", "<string>", "exec"), namespace)  # noqa: S102 - the case under test
    frame = namespace["frame"]
    assert inspect.getmodule(frame, "<string>") is None
    assert inspect.getframeinfo(frame).code_context is None
