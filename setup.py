"""The one native part: the journal's id rule scans (zerocomm_spark/journal/_idrule.c).

Everything else is declared in pyproject.toml. The extension is optional: without a C compiler the
package still installs and the journal uses its numpy path (the same answers, slower appends of
small messages); tests compare the two paths wherever the extension is built.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("zerocomm_spark.journal._idrule", ["zerocomm_spark/journal/_idrule.c"],
                             extra_compile_args=["-O3"], optional=True)])
