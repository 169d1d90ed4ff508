/* The compiled fast paths of ocxproxy: each function here does in one call what the
 * pure-Python code beside its caller does in several, for the common case only, and
 * answers None when the case is not its own (the caller then takes the Python path).
 * ocxproxy/speedups.py loads this module; its callers never need it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifndef SOURCE_DIGEST
#define SOURCE_DIGEST ""
#endif

static PyMethodDef speedups_methods[] = {
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT, "ocxproxy._speedups", NULL, -1, speedups_methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    PyObject *module = PyModule_Create(&speedups_module);
    if (module != NULL && PyModule_AddStringConstant(module, "SOURCE_DIGEST", SOURCE_DIGEST) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
