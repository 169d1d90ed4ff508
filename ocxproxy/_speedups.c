/* The compiled fast paths of ocxproxy: each function here does in one call what the
 * pure-Python code beside its caller does in several, for the common case only, and
 * answers None when the case is not its own (the caller then takes the Python path).
 * ocxproxy/speedups.py loads this module; its callers never need it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>
#include <time.h>

#ifndef SOURCE_DIGEST
#define SOURCE_DIGEST ""
#endif

/* A branch the usual case does not take, and a function it does not call: laid out
 * apart from the code it runs. A usual call runs once per turn, after the rest of the turn
 * has evicted its code, so each line of code it spans is a miss. */
#if defined(__GNUC__) || defined(__clang__)
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
#define COLD __attribute__((cold, noinline))
#else
#define LIKELY(x) (x)
#define UNLIKELY(x) (x)
#define COLD Py_NO_INLINE
#endif

/* Names interned once at import (the only other object kept here: `no_members`). */
static PyObject *s__answer, *s__pending_event, *s__terminal_event, *s__shared_family,
    *s__shared_fill, *s_annotations, *s_at, *s_cached_tokens,
    *s_completed, *s_completed_at, *s_content, *s_created_at, *s_data, *s_encoded, *s_fast,
    *s_id, *s_input_tokens, *s_input_tokens_details, *s_members, *s_memo, *s_message, *s_model,
    *s_name, *s_output, *s_output_text, *s_output_tokens, *s_output_tokens_details, *s_previous,
    *s_previous_response_id, *s_raw, *s_reasoning, *s_reasoning_tokens, *s_response,
    *s_sequence_number, *s_status, *s_store, *s_total_tokens, *s_type, *s_usage;

/* ---- Envelope's and Patch's per-object state ----------------------------------------
 * The bases of continuation/envelope.py's Envelope and Patch when this module is built:
 * their members as a C struct (the same names, read and written from Python as slots
 * are), made without running a Python __init__ (an Envelope is made per request, a Patch
 * per Response), and read here without an attribute lookup. */

typedef struct {
    PyObject_HEAD
    PyObject *body, *members, *echo, *served_models, *created_at, *pinned, *defaults, *fills,
        *inserts, *family;
} EnvelopeState;

static PyObject *no_members; /* the empty dict a Patch's and an Envelope's defaults share
                              * (never changed: they are replaced, not updated) */

/* A state struct's object fields, a run of pointers (`first` to `last`, declared in one
 * line), visited and cleared in a loop that is not inlined nor unrolled: one function of
 * a few lines for every type, where a Py_CLEAR per field spans a line or two of each
 * dealloc (an Envelope is made and freed per request, a Patch per Response, and each line
 * of code they run is a miss). */
#define FIELDS(self, first, last) (&(self)->first), (&(self)->last + 1)

static int visit_fields(PyObject **field, PyObject **end, visitproc visit, void *arg) {
    for (; field < end; field++)
        Py_VISIT(*field);
    return 0;
}

static Py_NO_INLINE int clear_fields(PyObject **field, PyObject **end) {
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 1
#endif
    for (; field < end; field++)
        Py_CLEAR(*field);
    return 0;
}

static int envelope_traverse(EnvelopeState *self, visitproc visit, void *arg) {
    return visit_fields(FIELDS(self, body, family), visit, arg);
}

static int envelope_clear(EnvelopeState *self) {
    return clear_fields(FIELDS(self, body, family));
}

static void envelope_dealloc(EnvelopeState *self) {
    PyObject_GC_UnTrack(self);
    clear_fields(FIELDS(self, body, family));
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* An Envelope of `type` with these members (borrowed; `served` NULL: none). */
static PyObject *envelope_make(PyTypeObject *type, PyObject *body, PyObject *echo,
                               PyObject *served, PyObject *members, PyObject *created_at) {
    EnvelopeState *self = (EnvelopeState *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    /* Built for each create request: only what it is given is kept, the rest is worked
     * out when a Response needs it (see envelope.py's _EnvelopeState). */
    self->body = Py_NewRef(body == Py_None ? no_members : body);
    self->members = Py_NewRef(members);
    self->echo = Py_NewRef(echo);
    self->served_models = served == NULL ? PyTuple_New(0) : Py_NewRef(served);
    self->created_at = Py_NewRef(created_at);
    for (PyObject **field = &self->pinned; field <= &self->family; field++)
        *field = Py_NewRef(Py_None);
    if (self->served_models == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* Envelope(body=None, echo=None, served_models=(), members=None, *, created_at=None) */
static PyObject *envelope_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"body", "echo", "served_models", "members", "created_at", NULL};
    PyObject *body = Py_None, *echo = Py_None, *served = NULL, *members = Py_None,
             *created_at = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OOOO$O:Envelope", names, &body, &echo, &served,
                                     &members, &created_at))
        return NULL;
    return envelope_make(type, body, echo, served, members, created_at);
}

/* `type(*args, **kwnames)` as a type's call makes it (an argument tuple and dict). */
static COLD PyObject *type_call(PyObject *type, PyObject *const *args, Py_ssize_t n,
                                PyObject *kwnames) {
    PyObject *tuple = PyTuple_New(n), *kwds = NULL, *result = NULL;
    if (tuple == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) {
        if ((kwds = PyDict_New()) == NULL)
            goto done;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++)
            if (PyDict_SetItem(kwds, PyTuple_GET_ITEM(kwnames, i), args[n + i]) < 0)
                goto done;
    }
    result = PyType_Type.tp_call(type, tuple, kwds);
done:
    Py_DECREF(tuple);
    Py_XDECREF(kwds);
    return result;
}

/* The call of an Envelope type with positional arguments (the hot path's: one per create
 * request), made without the argument tuple `type(...)` builds, nor its __init__ call
 * (object's, which does nothing); any other call is type(...)'s. A heap type does not
 * inherit this (`vectorcall` below sets it on envelope.py's Envelope). */
static PyObject *envelope_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames) {
    PyTypeObject *type = (PyTypeObject *)callable;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (UNLIKELY(kwnames != NULL || n > 4 || type->tp_new != envelope_new
                 || type->tp_init != PyBaseObject_Type.tp_init))
        return type_call(callable, args, n, kwnames);
    return envelope_make(type, n > 0 ? args[0] : Py_None, n > 1 ? args[1] : Py_None,
                         n > 2 ? args[2] : NULL, n > 3 ? args[3] : Py_None, Py_None);
}

/* (T_OBJECT_EX: an attribute deleted is unset, as a slot's; the C here checks for NULL) */
#define MEMBER(type, field, name) {name, T_OBJECT_EX, offsetof(type, field), 0, NULL},

static PyMemberDef envelope_state_members[] = {
    MEMBER(EnvelopeState, body, "_body") MEMBER(EnvelopeState, members, "_members")
    MEMBER(EnvelopeState, echo, "_echo") MEMBER(EnvelopeState, served_models, "_served_models")
    MEMBER(EnvelopeState, created_at, "_created_at") MEMBER(EnvelopeState, pinned, "_pinned")
    MEMBER(EnvelopeState, defaults, "_defaults") MEMBER(EnvelopeState, fills, "_fills")
    MEMBER(EnvelopeState, inserts, "_inserts") MEMBER(EnvelopeState, family, "_family")
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject EnvelopeState_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ocxproxy._speedups.EnvelopeState",
    .tp_basicsize = sizeof(EnvelopeState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The members of an Envelope (continuation/envelope.py), as a C struct.",
    .tp_traverse = (traverseproc)envelope_traverse,
    .tp_clear = (inquiry)envelope_clear,
    .tp_dealloc = (destructor)envelope_dealloc,
    .tp_members = envelope_state_members,
    .tp_new = envelope_new,
    .tp_vectorcall = envelope_vectorcall,
};

/* (its flags and numbers are C values: no object to hold or release for them) */
typedef struct {
    PyObject_HEAD
    PyObject *plan, *filled, *encoded, *inserted, *ids, *fill, *own;
    Py_ssize_t fill_in, fill_at;
    char rewrite, items, unmerged;
} PatchState;

static int patch_traverse(PatchState *self, visitproc visit, void *arg) {
    return visit_fields(FIELDS(self, plan, own), visit, arg);
}

static int patch_clear(PatchState *self) {
    return clear_fields(FIELDS(self, plan, own));
}

static void patch_dealloc(PatchState *self) {
    PyObject_GC_UnTrack(self);
    clear_fields(FIELDS(self, plan, own));
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A Patch's default values that are not singletons of their own: b"" and () (made once,
 * at import: a Patch is made for every Response); and -1, the `at` of an event framed by
 * `wire` (its raw bytes b""). */
static PyObject *no_bytes, *no_items, *minus_one;

/* A Patch with its defaults (those of envelope.py's _PatchState; its flags false, from
 * the allocation's zeros). */
static PatchState *patch_make(PyTypeObject *type) {
    PatchState *self = (PatchState *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->encoded = Py_NewRef(no_bytes);
    self->fill = Py_NewRef(no_bytes);
    self->ids = Py_NewRef(no_items);
    self->own = Py_NewRef(no_items);
    self->fill_at = -1;
    self->plan = Py_NewRef(Py_None);
    self->filled = Py_NewRef(no_members);
    self->inserted = Py_NewRef(no_members);
    return self;
}

static PyObject *patch_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Patch() takes no arguments");
        return NULL;
    }
    return (PyObject *)patch_make(type);
}

static PyMemberDef patch_state_members[] = {
    MEMBER(PatchState, plan, "plan") MEMBER(PatchState, filled, "filled")
    MEMBER(PatchState, encoded, "encoded") MEMBER(PatchState, inserted, "inserted")
    MEMBER(PatchState, ids, "ids") MEMBER(PatchState, fill, "fill")
    MEMBER(PatchState, own, "own")
    {"rewrite", T_BOOL, offsetof(PatchState, rewrite), 0, NULL},
    {"items", T_BOOL, offsetof(PatchState, items), 0, NULL},
    {"unmerged", T_BOOL, offsetof(PatchState, unmerged), 0, NULL},
    {"fill_in", T_PYSSIZET, offsetof(PatchState, fill_in), 0, NULL},
    {"fill_at", T_PYSSIZET, offsetof(PatchState, fill_at), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject PatchState_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ocxproxy._speedups.PatchState",
    .tp_basicsize = sizeof(PatchState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The members of a Patch (continuation/envelope.py), as a C struct.",
    .tp_traverse = (traverseproc)patch_traverse,
    .tp_clear = (inquiry)patch_clear,
    .tp_dealloc = (destructor)patch_dealloc,
    .tp_members = patch_state_members,
    .tp_new = patch_new,
};

/* A field of a struct set to a new reference (`value` stolen; NULL: an error). */
static int set_field(PyObject **field, PyObject *value) {
    if (value == NULL)
        return -1;
    Py_XSETREF(*field, value);
    return 0;
}

/* ---- small helpers ---------------------------------------------------------------- */

/* A run of bytes a spliced Response is built from. */
typedef struct {
    const char *ptr;
    Py_ssize_t len;
} Piece;

#define MAX_PIECES 4

/* Whether two exact strs are equal: the same characters in the same (canonical) kind. */
static int same_str(PyObject *a, PyObject *b) {
#if PY_VERSION_HEX < 0x030C0000
    if (!PyUnicode_IS_READY(a) || !PyUnicode_IS_READY(b)) /* (a legacy str, never orjson's) */
        return PyUnicode_Compare(a, b) == 0;
#endif
    Py_ssize_t n = PyUnicode_GET_LENGTH(a);
    int kind = PyUnicode_KIND(a);
    return n == PyUnicode_GET_LENGTH(b) && kind == (int)PyUnicode_KIND(b)
        && memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), (size_t)n * (size_t)kind) == 0;
}

/* Whether `value` is an exact str equal to the ASCII `name` (a compare, no allocation). */
static int is_str(PyObject *value, PyObject *name) {
    if (value == name)
        return 1;
    return PyUnicode_CheckExact(value) && same_str(value, name);
}

/* A dict's exact-int member, as `type(d[name]) is int` checks it: 1 yes, 0 no. */
static int int_member(PyObject *dict, PyObject *name) {
    PyObject *value = PyDict_GetItemWithError(dict, name);
    return value != NULL && PyLong_CheckExact(value);
}

/* ---- dicts known by their keys ----------------------------------------------------
 * A backend writes each kind of object (usage, its details, a message, an output text)
 * with the same members in the same order turn after turn, and orjson gives a key the
 * same str object each time (its key cache): such a dict is known by one pass that
 * compares its keys' addresses with those of the last one found usual, instead of a
 * lookup (a hash probe and a string compare) per member. */

#define KEYS_MAX 8
#define NAMES_MAX 5

/* (What `known_values` reads first, on one cache line for up to 5 keys: a turn finds it
 * evicted.) */
typedef struct {
    _Alignas(64) Py_ssize_t n; /* 0: none learnt yet */
    int count;
    unsigned char at[NAMES_MAX]; /* where the members read are among `keys` */
    PyObject *keys[KEYS_MAX]; /* (strong references, kept for the process) */
    PyObject **names[NAMES_MAX]; /* the members read */
} Keys;

static Keys usage_keys = {.count = 5, .names = {&s_input_tokens, &s_output_tokens,
    &s_total_tokens, &s_input_tokens_details, &s_output_tokens_details}};
static Keys cached_keys = {.count = 1, .names = {&s_cached_tokens}};
static Keys reasoning_keys = {.count = 1, .names = {&s_reasoning_tokens}};
static Keys message_keys = {.count = 3, .names = {&s_status, &s_type, &s_content}};
static Keys part_keys = {.count = 2, .names = {&s_type, &s_annotations}};

/* `dict`'s values of `known`'s names (borrowed) when its keys are the very objects
 * learnt, in their order: 1; else 0. (No Python code runs.) */
static int known_values(PyObject *dict, const Keys *known, PyObject **values) {
    Py_ssize_t n = known->n;
    if (n == 0 || PyDict_GET_SIZE(dict) != n)
        return 0;
    PyObject *all[KEYS_MAX], *key, *value;
    Py_ssize_t pos = 0, i = 0;
    while (PyDict_Next(dict, &pos, &key, &value)) {
        if (i >= n || key != known->keys[i])
            return 0;
        all[i++] = value;
    }
    if (i != n)
        return 0;
    for (int j = 0; j < known->count; j++)
        values[j] = all[known->at[j]];
    return 1;
}

/* `dict`'s keys learnt (it was found usual by lookups), when they are few exact strs
 * among which are `known`'s names. */
static void learn(PyObject *dict, Keys *known) {
    Py_ssize_t n = PyDict_GET_SIZE(dict), pos = 0, i = 0, at[NAMES_MAX];
    PyObject *keys[KEYS_MAX], *key, *value;
    if (n == 0 || n > KEYS_MAX)
        return;
    while (PyDict_Next(dict, &pos, &key, &value)) {
        if (i >= n || !PyUnicode_CheckExact(key))
            return;
        keys[i++] = key;
    }
    if (i != n)
        return;
    for (int j = 0; j < known->count; j++) {
        for (at[j] = 0; at[j] < n && !is_str(keys[at[j]], *known->names[j]); at[j]++)
            ;
        if (at[j] == n)
            return;
    }
    for (i = 0; i < n; i++) /* (a str's release runs no Python code) */
        Py_INCREF(keys[i]);
    for (i = 0; i < known->n; i++)
        Py_DECREF(known->keys[i]);
    memcpy(known->keys, keys, sizeof(PyObject *) * (size_t)n);
    for (int j = 0; j < known->count; j++)
        known->at[j] = (unsigned char)at[j];
    known->n = n;
}

/* The checks below hold each dict and list they look into: a lookup compares a key of
 * the same hash, whose __eq__ (an object's, not a str's) may run Python code that takes
 * the dict out of what holds it. */

/* A usage's details: a dict whose `known` member is an exact int. */
static int details_known(PyObject *details, Keys *known) {
    PyObject *value;
    if (!PyDict_CheckExact(details))
        return 0;
    if (known_values(details, known, &value))
        return PyLong_CheckExact(value);
    Py_INCREF(details);
    int usual = int_member(details, *known->names[0]);
    if (usual)
        learn(details, known);
    Py_DECREF(details);
    return usual;
}

/* `usage[name]`: details whose `known` member is an exact int. */
static int details_usual(PyObject *usage, PyObject *name, Keys *known) {
    PyObject *details = PyDict_GetItemWithError(usage, name);
    return details != NULL && details_known(details, known);
}

/* `_usage_changed`'s quick check: the usual usage (1), or one the Python path must see (0). */
static int usage_usual(PyObject *usage) {
    PyObject *v[5];
    if (usage == Py_None)
        return 1;
    if (!PyDict_CheckExact(usage))
        return 0;
    if (known_values(usage, &usage_keys, v)) {
        if (!PyLong_CheckExact(v[0]) || !PyLong_CheckExact(v[1]) || !PyLong_CheckExact(v[2]))
            return 0;
        /* (held: a lookup in the first details may run Python code that frees the second) */
        PyObject *output_details = Py_NewRef(v[4]);
        int usual = details_known(v[3], &cached_keys)
            && details_known(output_details, &reasoning_keys);
        Py_DECREF(output_details);
        return usual;
    }
    int usual = int_member(usage, s_input_tokens) && int_member(usage, s_output_tokens)
        && int_member(usage, s_total_tokens)
        && details_usual(usage, s_input_tokens_details, &cached_keys)
        && details_usual(usage, s_output_tokens_details, &reasoning_keys);
    if (usual)
        learn(usage, &usage_keys);
    return usual;
}

/* Whether `check` finds every item of the list usual (0 when one is not, or on error). */
static int all_usual(PyObject *list, int (*check)(PyObject *)) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        PyObject *item = Py_NewRef(PyList_GET_ITEM(list, i));
        int usual = check(item);
        Py_DECREF(item);
        if (!usual)
            return 0;
    }
    return 1;
}

/* An output text with its annotations. */
static int part_usual(PyObject *part) {
    PyObject *v[2];
    if (!PyDict_CheckExact(part))
        return 0;
    if (known_values(part, &part_keys, v))
        return is_str(v[0], s_output_text) && PyList_CheckExact(v[1]);
    PyObject *type = PyDict_GetItemWithError(part, s_type);
    if (type == NULL || !is_str(type, s_output_text))
        return 0;
    PyObject *annotations = PyDict_GetItemWithError(part, s_annotations);
    if (annotations == NULL || !PyList_CheckExact(annotations))
        return 0;
    learn(part, &part_keys);
    return 1;
}

/* `_item_complete` for the usual items: 1 complete, 0 not or not the usual kind. (The
 * keys learnt are a message's: another kind is checked by lookups.) */
static int item_usual(PyObject *item) {
    PyObject *v[3], *kind, *content;
    if (!PyDict_CheckExact(item))
        return 0;
    int known = known_values(item, &message_keys, v);
    if (known)
        kind = v[1];
    else if (PyDict_GetItemWithError(item, s_status) == NULL
             || (kind = PyDict_GetItemWithError(item, s_type)) == NULL)
        return 0;
    if (!PyUnicode_CheckExact(kind))
        return 0;
    if (!is_str(kind, s_message))
        return !is_str(kind, s_reasoning);
    content = known ? v[2] : PyDict_GetItemWithError(item, s_content);
    if (content == NULL || !PyList_CheckExact(content))
        return 0;
    Py_INCREF(content);
    int usual = all_usual(content, part_usual);
    Py_DECREF(content);
    if (usual && !known)
        learn(item, &message_keys);
    return usual;
}

#define MAX_MEMBERS 64 /* (a Response with more is left to the Python) */

/* `(a, b)`, a new reference (NULL on error): PyTuple_Pack's without its variable
 * arguments. */
static PyObject *pair(PyObject *a, PyObject *b) {
    PyObject *tuple = PyTuple_New(2);
    if (tuple != NULL) {
        PyTuple_SET_ITEM(tuple, 0, Py_NewRef(a));
        PyTuple_SET_ITEM(tuple, 1, Py_NewRef(b));
    }
    return tuple;
}

/* An exact tuple's item, or NULL (no exception) when it has too few. */
static PyObject *item_of(PyObject *tuple, Py_ssize_t i) {
    if (!PyTuple_CheckExact(tuple) || PyTuple_GET_SIZE(tuple) <= i)
        return NULL;
    return PyTuple_GET_ITEM(tuple, i);
}

/* The int at `tuple[i]` if it is a place in `n` members or -1; else -2. */
static Py_ssize_t place(PyObject *tuple, Py_ssize_t i, Py_ssize_t n) {
    PyObject *value = item_of(tuple, i);
    if (value == NULL || !PyLong_CheckExact(value))
        return -2;
    Py_ssize_t at = PyLong_AsSsize_t(value);
    if (at == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -2;
    }
    return at >= -1 && at < n ? at : -2;
}

/* The decimal digits of `value` (as Python's `%d` writes them) at `out`, which has room
 * for 21 bytes: their count. */
static int digits(char *out, long long value) {
    char buffer[24];
    int n = 0;
    unsigned long long left = (unsigned long long)value;
    if (value < 0)
        left = 0ULL - left;
    do {
        buffer[n++] = (char)('0' + left % 10);
        left /= 10;
    } while (left);
    int width = 0;
    if (value < 0)
        out[width++] = '-';
    while (n)
        out[width++] = buffer[--n];
    return width;
}

/* `int(time.time())`: the realtime clock's whole seconds. */
static int now_seconds(long long *out) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    *out = (long long)ts.tv_sec;
    return 0;
}

/* The second last read from the clock for a Response (created_at, completed_at), as an
 * int object and as its digits: the next Response in the same second reuses both. */
static struct {
    long long seconds;
    PyObject *value; /* (a strong reference, kept until the next second's) */
    char digits[24];
    int len;
} stamp;

/* `seconds` as an int object (a new reference, NULL on error) with its digits, from the
 * last second's when it is the same. */
static PyObject *stamp_of(long long seconds, const char **chars, int *len) {
    if (stamp.value == NULL || stamp.seconds != seconds) {
        PyObject *value = PyLong_FromLongLong(seconds);
        if (value == NULL)
            return NULL;
        Py_XSETREF(stamp.value, value); /* (an int's release runs no Python code) */
        stamp.seconds = seconds;
        stamp.len = digits(stamp.digits, seconds);
    }
    *chars = stamp.digits;
    *len = stamp.len;
    return Py_NewRef(stamp.value);
}

/* An attribute read, as a new reference (NULL with an exception set on failure). */
#define GET(obj, name) PyObject_GetAttr((obj), (name))

/* `_Plan.fast` and `_Fill.fast`, read at their slots' offsets (below: `Slot`). */
static PyObject *fast_of_plan(PyObject *plan);
static PyObject *fast_of_fill(PyObject *fill);


/* `a == b` as Python's tuple compare decides it (identity first; two strs, or two empty
 * lists, compared here at once). */
static int equal(PyObject *a, PyObject *b) {
    if (a == b)
        return 1;
    if (PyUnicode_CheckExact(a) && PyUnicode_CheckExact(b))
        return same_str(a, b);
    if (PyList_CheckExact(a) && PyList_CheckExact(b) && !PyList_GET_SIZE(a) && !PyList_GET_SIZE(b))
        return 1;
    return PyObject_RichCompareBool(a, b, Py_EQ);
}

/* ---- Envelope.answer and Envelope.terminal_event: their common case ------------------ */

/* The keys of the last request body found to have none of `disjoint_from`'s (the names
 * of the members filled from the request), learnt as `Keys` are: a client sends the same
 * members turn after turn, and orjson gives them the same key objects. Its model is read
 * at its place (a body without one is not learnt). */
static Keys disjoint_keys = {.count = 1, .names = {&s_model}};
static PyObject *disjoint_from; /* (a strong reference) */

/* The request's fills found at once (`Envelope._shared_fill`'s key, compared with the
 * last request's): a new reference to the family, None when not found so (the Python
 * then finds it), NULL on error. */
static PyObject *quick_family(EnvelopeState *env, PyObject *served, PyObject *last_fills,
                              PyObject *from_request) {
    PyObject *last_key = item_of(last_fills, 0), *last_family = item_of(last_fills, 1);
    PyObject *body = Py_XNewRef(env->body), *members = NULL, *shown = NULL, *found = Py_None;
    if (last_family == NULL || !PyTuple_CheckExact(last_key) || !PyDict_CheckExact(last_family)
        || !PyFrozenSet_CheckExact(from_request) || body == NULL || !PyDict_CheckExact(body))
        goto done;
    int disjoint = 1;
    PyObject *model = NULL; /* (the body's, when known by its keys) */
    if (from_request != disjoint_from || !known_values(body, &disjoint_keys, &model)) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(body, &pos, &key, &value)) {
            if (!PyUnicode_CheckExact(key)) /* (hashed and compared: Python code) */
                goto done;
            int in = PySet_Contains(from_request, key);
            if (in < 0)
                goto fail;
            if (in) {
                disjoint = 0;
                break;
            }
        }
        if (disjoint) { /* (the next request's, the same keys, known by their addresses) */
            learn(body, &disjoint_keys);
            if (known_values(body, &disjoint_keys, &model))
                Py_XSETREF(disjoint_from, Py_NewRef(from_request)); /* (a set of strs) */
        }
    }
    int same;
    if (disjoint) { /* (served_models, the model if a str) */
        if (model == NULL && (model = PyDict_GetItemWithError(body, s_model)) == NULL
            && PyErr_Occurred())
            goto fail;
        /* (held: comparing the served models may change the body) */
        shown = Py_NewRef(model != NULL && PyUnicode_CheckExact(model) ? model : Py_None);
        if (PyTuple_GET_SIZE(last_key) != 2)
            goto done;
        same = equal(served, PyTuple_GET_ITEM(last_key, 0));
        if (same > 0)
            same = equal(shown, PyTuple_GET_ITEM(last_key, 1));
    } else { /* (served_models, None, None, the members' bytes as forwarded) */
        PyObject *store = PyDict_GetItemWithError(body, s_store);
        if (store == NULL && PyErr_Occurred())
            goto fail;
        if (store == Py_False || PyTuple_GET_SIZE(last_key) != 4)
            goto done;
        members = Py_XNewRef(env->members);
        if (members == NULL || members == Py_None)
            goto done;
        same = equal(served, PyTuple_GET_ITEM(last_key, 0));
        if (same > 0)
            same = equal(Py_None, PyTuple_GET_ITEM(last_key, 1));
        if (same > 0)
            same = equal(Py_None, PyTuple_GET_ITEM(last_key, 2));
        if (same > 0)
            same = equal(members, PyTuple_GET_ITEM(last_key, 3));
    }
    if (same < 0)
        goto fail;
    if (same)
        found = last_family;
done:
    Py_XDECREF(body);
    Py_XDECREF(members);
    Py_XDECREF(shown);
    return Py_NewRef(found);
fail:
    Py_XDECREF(body);
    Py_XDECREF(members);
    Py_XDECREF(shown);
    return NULL;
}

/* The _Fill of `missing` for this Envelope (`Envelope._shared_fill`, its usual lookup
 * done here): a new reference, NULL on error. */
static PyObject *shared_fill(EnvelopeState *env, PyObject *missing, PyObject *served,
                             PyObject *last_fills, PyObject *from_request) {
    PyObject *family = Py_XNewRef(env->family);
    if (family == NULL || family == Py_None) {
        Py_XDECREF(family);
        family = quick_family(env, served, last_fills, from_request);
        if (family == NULL)
            return NULL;
        if (family != Py_None)
            Py_XSETREF(env->family, Py_NewRef(family));
    }
    if (PyDict_CheckExact(family)) {
        PyObject *fill = PyDict_GetItemWithError(family, missing);
        if (fill != NULL) {
            Py_INCREF(fill);
            Py_DECREF(family);
            return fill;
        }
        if (PyErr_Occurred()) {
            Py_DECREF(family);
            return NULL;
        }
    }
    Py_DECREF(family);
    return PyObject_CallMethodOneArg((PyObject *)env, s__shared_fill, missing);
}

/* Whether `value` is a str orjson writes as its characters between quotes (ASCII, no
 * quote, backslash or control character): then its bytes are its JSON string's. */
static int plain_ascii(PyObject *value, const char **chars, Py_ssize_t *len) {
    if (!PyUnicode_CheckExact(value) || !PyUnicode_IS_ASCII(value))
        return 0;
    const char *p = (const char *)PyUnicode_1BYTE_DATA(value);
    Py_ssize_t n = PyUnicode_GET_LENGTH(value), i = 0;
    /* Eight at a time (ASCII: every byte is below 0x80, so a subtraction's borrow sets a
     * byte's high bit only below 0x20 or at a byte equal to the one xor'ed out; a false
     * alarm only sends the word to the byte loop). */
    const uint64_t ones = 0x0101010101010101ULL, highs = 0x8080808080808080ULL;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        if (((w - ones * 0x20) | ((w ^ ones * '"') - ones) | ((w ^ ones * '\\') - ones)
             | ((w ^ ones * 0x7F) - ones))
            & highs)
            break;
    }
    for (; i < n; i++)
        if (p[i] < 0x20 || p[i] == '"' || p[i] == '\\' || p[i] == 0x7F)
            return 0;
    *chars = p;
    *len = n;
    return 1;
}

/* What an answer's plan says (`_Plan.fast`), checked once for the plan last seen: a
 * backend answers in one shape turn after turn. Its places (each checked against the
 * answer's count of members `n`): of usage, the output, the status and completed_at (-1:
 * absent), and of its ruled values; the members it lacks, whether it stamps completed_at,
 * the ruled values seen valid. */
typedef struct {
    _Alignas(64) PyObject *fast; /* (a strong reference: the tuple the rest was read from) */
    PyObject *missing, *valid; /* (borrowed from `fast`) */
    int stamp, lacks; /* completed_at stamped; `missing` not empty */
    Py_ssize_t n, at[4], count, names[MAX_MEMBERS];
} Places;

static Places places;

/* `fast`'s places in `n` members, copied to `out` (its members borrowed from `fast`): 1;
 * 0 when one is not a place in `n` members, or a member of `fast` is not of its type. */
static int places_of(PyObject *fast, Py_ssize_t n, Places *out) {
    PyObject *old = NULL;
    if (places.fast != fast || places.n != n) {
        PyObject *missing = item_of(fast, 0), *stamp = item_of(fast, 1),
                 *ruled = item_of(fast, 3), *valid = item_of(fast, 4);
        Py_ssize_t found[4] = {place(fast, 2, n), place(fast, 5, n), place(fast, 6, n),
                               place(fast, 7, n)};
        if (found[0] < -1 || found[1] < -1 || found[2] < -1 || found[3] < -1 || ruled == NULL
            || !PyTuple_CheckExact(ruled) || PyTuple_GET_SIZE(ruled) > MAX_MEMBERS
            || !PyFrozenSet_CheckExact(missing) || !PyBool_Check(stamp)
            || !PyTuple_CheckExact(valid) || PyTuple_GET_SIZE(valid) != PyTuple_GET_SIZE(ruled))
            return 0;
        Py_ssize_t names[MAX_MEMBERS];
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ruled); i++)
            if ((names[i] = place(ruled, i, n)) < 0)
                return 0;
        old = places.fast; /* (released once `out` is copied: its release may run Python) */
        places.fast = Py_NewRef(fast);
        places.missing = missing;
        places.valid = valid;
        places.stamp = stamp == Py_True;
        places.lacks = PySet_GET_SIZE(missing) != 0;
        places.n = n;
        memcpy(places.at, found, sizeof(found));
        places.count = PyTuple_GET_SIZE(ruled);
        memcpy(places.names, names, sizeof(Py_ssize_t) * (size_t)places.count);
    }
    out->missing = places.missing;
    out->valid = places.valid;
    out->stamp = places.stamp;
    out->lacks = places.lacks;
    memcpy(out->at, places.at, sizeof(places.at));
    out->count = places.count;
    memcpy(out->names, places.names, sizeof(Py_ssize_t) * (size_t)places.count);
    Py_XDECREF(old);
    return 1;
}

/* What a fill says (`_Fill.fast`: created_at, previous, encoded, members), checked once
 * for the fill last seen: a request's fills are those of the last one. */
typedef struct {
    _Alignas(64) PyObject *fast; /* (a strong reference: the tuple the rest was read from) */
    PyObject *encoded, *filled; /* (borrowed from `fast`) */
    int created, previous;
} Fills;

static Fills fills;

/* `fast`'s members, copied to `out` (borrowed from `fast`): 1; 0 when one is not of its
 * type. */
static int fill_of(PyObject *fast, Fills *out) {
    PyObject *old = NULL;
    if (fills.fast != fast) {
        PyObject *created = item_of(fast, 0), *previous = item_of(fast, 1),
                 *encoded = item_of(fast, 2), *filled = item_of(fast, 3);
        if (filled == NULL || !PyBool_Check(created) || !PyBool_Check(previous)
            || !PyBytes_CheckExact(encoded))
            return 0;
        old = fills.fast; /* (released once `out` is copied: its release may run Python) */
        fills = (Fills){Py_NewRef(fast), encoded, filled, created == Py_True,
                        previous == Py_True};
    }
    *out = fills;
    Py_XDECREF(old);
    return 1;
}

#define OWN_SIZE 512

/* Whether `served` is a tuple that truth, `in` and `[0]` read as a tuple (a subclass that
 * overrides none of them, as ServedModels): 1, else 0. */
static int as_tuple(PyObject *served) {
    if (PyTuple_CheckExact(served))
        return 1;
    PyTypeObject *type = Py_TYPE(served);
    PySequenceMethods *sequence = type->tp_as_sequence, *tuple = PyTuple_Type.tp_as_sequence;
    return PyTuple_Check(served) && sequence != NULL && type->tp_as_mapping != NULL
        && sequence->sq_length == tuple->sq_length && sequence->sq_contains == tuple->sq_contains
        && type->tp_as_mapping->mp_subscript == PyTuple_Type.tp_as_mapping->mp_subscript
        && (type->tp_as_number == NULL || type->tp_as_number->nb_bool == NULL);
}

/* Whether `model` is the one `Envelope._shown_model` shows with the served model names
 * `served` (a tuple, `as_tuple`, not empty): the request's when it is one of them, else
 * the first. 1 yes; 0 no, or not a case of its own (a name or the request's model not a
 * str: the Python's); -1 an error. */
static int shows_model(EnvelopeState *env, PyObject *served, PyObject *model) {
    if (!PyUnicode_CheckExact(model))
        return 0;
    PyObject *body = Py_XNewRef(env->body); /* (held: a lookup may run a key's __eq__) */
    if (body == NULL || !PyDict_CheckExact(body)) {
        Py_XDECREF(body);
        return 0;
    }
    PyObject *requested = PyDict_GetItemWithError(body, s_model); /* (no Python code after) */
    int result = 0;
    if (requested == NULL && PyErr_Occurred())
        result = -1;
    else if (requested == NULL || requested == Py_None || PyUnicode_CheckExact(requested)) {
        PyObject *shown = PyTuple_GET_ITEM(served, 0);
        int named = requested == NULL || requested == Py_None; /* (none: the first) */
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(served); k++) {
            PyObject *name = PyTuple_GET_ITEM(served, k);
            if (!PyUnicode_CheckExact(name)) {
                shown = NULL;
                break;
            }
            if (!named && same_str(requested, name)) {
                shown = name;
                named = 1;
            }
        }
        result = shown != NULL && same_str(model, shown);
    }
    Py_DECREF(body);
    return result;
}

/* The members a Response of the shape last seen valid gets, as the Python's `answer`
 * decides them for the usual answer (`args`: the Envelope, the Response's dict, the
 * length of its bytes, and what the Python keeps: the last valid answer's members,
 * types and plan, the last request's fills, `_FROM_REQUEST`, `Patch`). */
typedef struct {
    PyObject *env, *response, *last, *last_fills, *from_request, *patch_type;
    Py_ssize_t data_len;
} AnswerArgs;

typedef struct {
    Piece pieces[MAX_PIECES]; /* the members' bytes, to be joined with commas */
    int count;
    char own[OWN_SIZE]; /* created_at's and previous_response_id's bytes */
    char stamp[48]; /* completed_at's bytes */
    PyObject *patch;
    PyObject *fill; /* holds the shared bytes a piece points into */
} Answer;

static Py_ssize_t answer_len(const Answer *a) {
    Py_ssize_t total = a->count > 1 ? a->count - 1 : 0;
    for (int i = 0; i < a->count; i++)
        total += a->pieces[i].len;
    return total;
}

static char *answer_write(const Answer *a, char *out) {
    for (int i = 0; i < a->count; i++) {
        if (i)
            *out++ = ',';
        memcpy(out, a->pieces[i].ptr, (size_t)a->pieces[i].len);
        out += a->pieces[i].len;
    }
    return out;
}

static void answer_clear(Answer *a) {
    Py_CLEAR(a->patch);
    Py_CLEAR(a->fill);
}

/* The subtypes of EnvelopeState and PatchState last seen (strong references: their
 * addresses are not reused meanwhile): an Envelope and a Patch are of the same ones
 * request after request. */
static PyTypeObject *envelope_type, *patch_type;

/* Whether `type` is a subtype of `base` (found so once, and kept in `*seen`). */
static int subtype_of(PyObject *type, PyTypeObject *base, PyTypeObject **seen) {
    if ((PyTypeObject *)type == *seen)
        return 1;
    if (!PyType_Check(type) || !PyType_IsSubtype((PyTypeObject *)type, base))
        return 0;
    Py_INCREF(type);
    Py_XSETREF(*seen, (PyTypeObject *)type); /* (a type's release runs no Python code) */
    return 1;
}

/* 1: `out` holds the members and a new Patch, the dict's members are set; 0: not the
 * usual case, nothing changed (but the Envelope's fills and created_at, which the
 * Python finds the same way); -1: an error. */
static int answer_members(const AnswerArgs *args, Answer *out) {
    PyObject *response = args->response;
    PyObject *keys = item_of(args->last, 0), *types = item_of(args->last, 1),
             *plan = item_of(args->last, 2);
    PyObject *fast = NULL, *served = NULL, *echo = NULL, *fill = NULL, *fill_fast = NULL,
             *created = NULL, *completed_at = NULL;
    PyObject *encoded = NULL, *filled = NULL; /* (borrowed from fill_fast) */
    PyObject *values[MAX_MEMBERS]; /* (the dict's, held once the shape is its own) */
    Py_ssize_t held = 0;
    PatchState *patch = NULL;
    PyObject *previous = NULL; /* borrowed */
    int result = 0;
    out->count = 0;
    out->patch = out->fill = NULL;
    if (plan == NULL || !PyTuple_CheckExact(keys) || !PyTuple_CheckExact(types)
        || plan == Py_None || !PyDict_CheckExact(response)
        || !subtype_of((PyObject *)Py_TYPE(args->env), &EnvelopeState_Type, &envelope_type)
        || !subtype_of(args->patch_type, &PatchState_Type, &patch_type))
        return 0;
    EnvelopeState *env = (EnvelopeState *)args->env;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (n == 0 || n > MAX_MEMBERS || PyTuple_GET_SIZE(types) != n
        || PyDict_GET_SIZE(response) != n)
        return 0;
    /* Its shape: the members, in order, and their types of the last answer seen valid. */
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(response, &pos, &key, &value)) {
        if (i >= n)
            return 0;
        PyObject *known = PyTuple_GET_ITEM(keys, i);
        if (key != known
            && !(PyUnicode_CheckExact(key) && PyUnicode_CheckExact(known)
                 && PyUnicode_Compare(key, known) == 0))
            return 0;
        if ((PyObject *)Py_TYPE(value) != PyTuple_GET_ITEM(types, i))
            return 0;
        values[i++] = value;
    }
    if (i != n)
        return 0;
    if (env->pinned != Py_None || env->served_models == NULL || env->echo == NULL)
        return 0; /* (pinned members, or one deleted: the Python's) */
    /* Held from here: a comparison, or the Envelope's _shared_fill, runs Python code,
     * which may take them out of the dict. */
    for (i = 0; i < n; i++)
        Py_INCREF(values[i]);
    held = n;
    if ((fast = fast_of_plan(plan)) == NULL) {
        result = -1;
        goto done;
    }
    served = Py_NewRef(env->served_models); /* (held: _shared_fill runs Python) */
    echo = Py_NewRef(env->echo);
    /* _Plan.fast: (missing, completed_at, where usage is, where the ruled values are,
     * those values seen valid, where the output and the status are), None until known */
    Places plan_says; /* (a copy: Python code a comparison runs may change `places`) */
    if (!places_of(fast, n, &plan_says))
        goto done;
    PyObject *missing = plan_says.missing, *valid = plan_says.valid; /* (held in `fast`) */
    const Py_ssize_t *names = plan_says.names, count = plan_says.count;
    Py_ssize_t usage_at = plan_says.at[0], output_at = plan_says.at[1],
               status_at = plan_says.at[2], stamped_at = plan_says.at[3];
    /* The values that do not change turn to turn are those last seen valid; with served
     * model names, the model is the one shown too (else the Python's to replace). */
    if (count && !(PyTuple_CheckExact(served) && !PyTuple_GET_SIZE(served))) {
        int shown = as_tuple(served);
        if (shown && PyTuple_GET_SIZE(served)) {
            for (i = 0; i < count; i++)
                if (is_str(PyTuple_GET_ITEM(keys, names[i]), s_model))
                    break;
            if (i < count)
                shown = shows_model(env, served, values[names[i]]);
        }
        if (shown <= 0) {
            result = shown;
            goto done;
        }
    }
    for (i = 0; i < count; i++) {
        int same = equal(values[names[i]], PyTuple_GET_ITEM(valid, i));
        if (same <= 0) {
            result = same;
            goto done;
        }
    }
    if (stamped_at >= 0 && values[stamped_at] == Py_None && status_at >= 0) {
        /* (the backend's completed_at: null for a completed Response is replaced) */
        int completed = equal(values[status_at], s_completed);
        if (completed != 0) {
            result = completed < 0 ? -1 : 0; /* (completed: the Python's to fill in) */
            goto done;
        }
    }
    if (usage_at >= 0 && !usage_usual(values[usage_at])) {
        result = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    /* Its output items: all of them as the schema wants them already. */
    if (output_at >= 0) {
        value = values[output_at];
        if (!PyList_CheckExact(value))
            goto done;
        if (!all_usual(value, item_usual)) {
            result = PyErr_Occurred() ? -1 : 0;
            goto done;
        }
    }
    /* The members filled in: the turn's own (created_at, the echoed id), then the shared
     * ones, then completed_at. */
    Py_ssize_t own = 0, fill_in = 0;
    int echoed = echo == Py_None;
    if (plan_says.lacks) {
        result = -1;
        if ((fill = shared_fill(env, missing, served, args->last_fills, args->from_request))
                == NULL
            || (fill_fast = fast_of_fill(fill)) == NULL)
            goto done;
        result = 0;
        Fills fill_says; /* (a copy: Python code a comparison runs may change `fills`) */
        if (!fill_of(fill_fast, &fill_says))
            goto done;
        encoded = fill_says.encoded; /* (held in `fill_fast`) */
        filled = fill_says.filled;
        if (fill_says.created) { /* Envelope._created */
            if (env->created_at == NULL) /* (deleted: the Python's) */
                goto done;
            const char *chars;
            int len;
            if (env->created_at == Py_None) {
                long long now;
                PyObject *value = NULL;
                if (now_seconds(&now) < 0 || (value = stamp_of(now, &chars, &len)) == NULL) {
                    result = -1;
                    goto done;
                }
                Py_XSETREF(env->created_at, value);
            }
            created = Py_NewRef(env->created_at);
            if (created == stamp.value) { /* (its digits at hand) */
                chars = stamp.digits;
                len = stamp.len;
            } else {
                if (!PyLong_CheckExact(created))
                    goto done;
                int overflow;
                long long value = PyLong_AsLongLongAndOverflow(created, &overflow);
                if (overflow || (value == -1 && PyErr_Occurred())) {
                    PyErr_Clear();
                    goto done;
                }
                len = digits(out->own + 13, value);
                chars = out->own + 13;
            }
            memcpy(out->own, "\"created_at\":", 13);
            memmove(out->own + 13, chars, (size_t)len);
            own = 13 + len;
            out->pieces[out->count++] = (Piece){out->own, own};
        }
        if (fill_says.previous) { /* the echoed id, which the backend never saw */
            previous = Py_None;
            PyObject *name = item_of(echo, 0), *id = item_of(echo, 1);
            if (id != NULL && PyTuple_GET_SIZE(echo) == 2) {
                int same = equal(name, s_previous_response_id);
                if (same < 0) {
                    result = -1;
                    goto done;
                }
                if (same)
                    previous = id;
            } else if (echo != Py_None)
                goto done; /* (not an echo the Python path would take apart either) */
            const char *chars = "null";
            Py_ssize_t len = 4;
            if (previous != Py_None) {
                if (!plain_ascii(previous, &chars, &len) || own + len + 32 > OWN_SIZE)
                    goto done;
                echoed = 1;
            }
            char *at = out->own + own;
            memcpy(at, "\"previous_response_id\":", 23);
            if (previous != Py_None)
                at[23] = '"';
            memcpy(at + 23 + (previous != Py_None), chars, (size_t)len);
            Py_ssize_t size = 23 + len + (previous != Py_None ? 2 : 0);
            if (previous != Py_None)
                at[size - 1] = '"';
            out->pieces[out->count++] = (Piece){at, size};
            own += size;
        }
        if (PyBytes_GET_SIZE(encoded)) {
            fill_in = own + out->count;
            out->pieces[out->count++]
                = (Piece){PyBytes_AS_STRING(encoded), PyBytes_GET_SIZE(encoded)};
        }
    }
    if (!echoed) { /* Envelope._check_echo: a usual answer's echoed member is its own */
        PyObject *name = item_of(echo, 0), *id = item_of(echo, 1);
        if (id == NULL || PyTuple_GET_SIZE(echo) != 2 || !PyUnicode_CheckExact(name)
            || is_str(name, s_created_at) || is_str(name, s_completed_at)
            || is_str(name, s_previous_response_id))
            goto done;
        value = PyDict_GetItemWithError(response, name);
        if (value == NULL || value == Py_None) {
            result = PyErr_Occurred() ? -1 : 0;
            goto done;
        }
    }
    if (plan_says.stamp) {
        int completed = 0;
        if (status_at >= 0)
            completed = equal(values[status_at], s_completed);
        if (completed < 0) {
            result = -1;
            goto done;
        }
        if (completed) {
            long long now;
            const char *chars;
            int len;
            if (now_seconds(&now) < 0 || (completed_at = stamp_of(now, &chars, &len)) == NULL) {
                result = -1;
                goto done;
            }
            memcpy(out->stamp, "\"completed_at\":", 15);
            memcpy(out->stamp + 15, chars, (size_t)len);
            out->pieces[out->count++] = (Piece){out->stamp, 15 + len};
        } else {
            completed_at = Py_NewRef(Py_None);
            memcpy(out->stamp, "\"completed_at\":null", 19);
            out->pieces[out->count++] = (Piece){out->stamp, 19};
        }
    }
    /* Everything is decided: the patch, and the turn's own members (as the Python decides
     * them): in the patch, for Patch.merge to put in the dict, or in the dict at once when
     * an echo was checked there after them. */
    result = -1;
    if ((patch = patch_make((PyTypeObject *)args->patch_type)) == NULL)
        goto done;
    Py_XSETREF(patch->plan, Py_NewRef(plan));
    PyObject *turns[6]; /* (name, value) pairs */
    int owns = 0;
    if (created != NULL) {
        turns[owns++] = s_created_at;
        turns[owns++] = created;
    }
    if (previous != NULL) {
        turns[owns++] = s_previous_response_id;
        turns[owns++] = previous;
    }
    if (completed_at != NULL) {
        turns[owns++] = s_completed_at;
        turns[owns++] = completed_at;
    }
    if (!echoed) {
        for (int k = 0; k < owns; k += 2)
            if (PyDict_SetItem(response, turns[k], turns[k + 1]) < 0)
                goto done;
    } else if (owns) {
        if (set_field(&patch->own, PyTuple_New(owns)) < 0)
            goto done;
        for (int k = 0; k < owns; k++)
            PyTuple_SET_ITEM(patch->own, k, Py_NewRef(turns[k]));
        patch->unmerged = 1;
    }
    if (encoded != NULL && PyBytes_GET_SIZE(encoded)) {
        patch->fill_in = fill_in;
        patch->fill_at = args->data_len + fill_in;
        Py_XSETREF(patch->fill, Py_NewRef(encoded));
        Py_XSETREF(patch->filled, Py_NewRef(filled));
        patch->unmerged = 1;
    }
    out->patch = Py_NewRef((PyObject *)patch);
    out->fill = Py_XNewRef(fill);
    result = 1;
done:
    Py_XDECREF(fast);
    Py_XDECREF(served);
    Py_XDECREF(echo);
    Py_XDECREF(fill);
    Py_XDECREF(fill_fast);
    for (i = 0; i < held; i++)
        Py_DECREF(values[i]);
    Py_XDECREF(created);
    Py_XDECREF(completed_at);
    Py_XDECREF(patch);
    return result;
}

/* answer(envelope, data, response, last_answer, last_fills, from_request, Patch):
 * Envelope.answer's usual answer, (the stored bytes, the patch), or None. */
static PyObject *answer(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "answer() takes 7 arguments");
        return NULL;
    }
    PyObject *data = args[1];
    if (!PyBytes_CheckExact(data) || PyBytes_GET_SIZE(data) < 2
        || PyBytes_AS_STRING(data)[PyBytes_GET_SIZE(data) - 1] != '}')
        Py_RETURN_NONE;
    Py_ssize_t len = PyBytes_GET_SIZE(data);
    AnswerArgs in = {args[0], args[2], args[3], args[4], args[5], args[6], len};
    Answer a;
    int done = answer_members(&in, &a);
    if (done <= 0) {
        if (done < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *stored;
    if (a.count == 0)
        stored = Py_NewRef(data);
    else { /* the members before its closing brace */
        stored = PyBytes_FromStringAndSize(NULL, len + 1 + answer_len(&a));
        if (stored != NULL) {
            char *at = PyBytes_AS_STRING(stored);
            memcpy(at, PyBytes_AS_STRING(data), (size_t)(len - 1));
            at += len - 1;
            *at++ = ',';
            at = answer_write(&a, at);
            *at = '}';
        }
    }
    PyObject *result = stored == NULL ? NULL : pair(stored, a.patch);
    Py_XDECREF(stored);
    answer_clear(&a);
    return result;
}

/* ---- Envelope.pending_event ------------------------------------------------------- */

/* An attribute kept in a __slots__ slot, read and written at its offset: a generic
 * getattr costs ~100 instructions, ten times this. The offset is the one the type's member
 * descriptor for the name gives, found again when the object's type or that type's
 * version (which changes when the type is) is not the one last seen; any other attribute
 * (no slot, a subclass's property, …) is read through the generic getattr (and an event
 * whose bytes are not such slots is not written here: `event_slots`). */
typedef struct {
    PyObject **name;
    PyTypeObject *type; /* (a strong reference: its address is not reused meanwhile) */
    unsigned int version;
    Py_ssize_t offset; /* 0: the generic way */
} Slot;

static COLD int slot_lookup(Slot *slot, PyTypeObject *type) {
    PyObject *descr = _PyType_Lookup(type, *slot->name); /* (borrowed) */
    Py_ssize_t offset = 0;
    /* (a type with its own __getattribute__ or __setattr__ sees every access) */
    if (descr != NULL && type->tp_getattro == PyObject_GenericGetAttr
        && type->tp_setattro == PyObject_GenericSetAttr && Py_IS_TYPE(descr, &PyMemberDescr_Type)
        && PyType_IsSubtype(type, PyDescr_TYPE(descr))) {
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type == T_OBJECT_EX && !(member->flags & READONLY)
            && member->offset >= (Py_ssize_t)sizeof(PyObject)
            && member->offset + (Py_ssize_t)sizeof(PyObject *) <= type->tp_basicsize) {
            offset = member->offset;
        }
    }
    Py_INCREF(type);
    Py_XSETREF(slot->type, type);
    slot->version = type->tp_version_tag; /* (0: none assigned, looked up again next time) */
    slot->offset = offset;
    return offset != 0;
}

static Py_ALWAYS_INLINE inline int slot_offset(Slot *slot, PyTypeObject *type) {
    if (slot->type == type && type->tp_version_tag == slot->version && slot->version != 0) {
        return slot->offset != 0;
    }
    return slot_lookup(slot, type);
}

/* The attribute's value (a new reference), NULL with an exception set. */
static Py_ALWAYS_INLINE inline PyObject *slot_get(Slot *slot, PyObject *object) {
    if (slot_offset(slot, Py_TYPE(object))) {
        PyObject *value = *(PyObject **)((char *)object + slot->offset);
        if (value != NULL) {
            Py_INCREF(value);
            return value;
        }
    }
    return PyObject_GetAttr(object, *slot->name); /* (raises when unset) */
}

static Slot event_name = {&s_name}, event_raw = {&s_raw}, event_data = {&s_data},
            event_at = {&s_at}, seen_members = {&s_members}, seen_memo = {&s_memo};

/* Whether an Event's `raw` and `data` are slots read and written at their offsets (else
 * the Python path completes it): then `set_event` changes both or neither. */
static int event_slots(PyObject *event) {
    PyTypeObject *type = Py_TYPE(event);
    return slot_offset(&event_raw, type) && slot_offset(&event_data, type);
}

/* An Event's `raw` and `data` set together, and its `at` unless NULL (-1 with an
 * exception when its type changed since `event_slots` found them slots). The old values
 * are released once all are set: their release may run Python code, which then sees the
 * event whole. */
static int set_event(PyObject *event, PyObject *raw, PyObject *data, PyObject *at) {
    if (!event_slots(event) || (at != NULL && !slot_offset(&event_at, Py_TYPE(event)))) {
        PyErr_SetString(PyExc_RuntimeError, "an event's type changed while it was completed");
        return -1;
    }
    PyObject **fields[3] = {(PyObject **)((char *)event + event_raw.offset),
                            (PyObject **)((char *)event + event_data.offset),
                            (PyObject **)((char *)event + event_at.offset)};
    PyObject *values[3] = {raw, data, at}, *old[3] = {NULL, NULL, NULL};
    for (int i = 0; i < 3 && values[i] != NULL; i++) {
        old[i] = *fields[i];
        *fields[i] = Py_NewRef(values[i]);
    }
    for (int i = 0; i < 3; i++)
        Py_XDECREF(old[i]);
    return 0;
}

/* Whether an event's raw[:at] is what `wire` writes before the payload of an event named
 * `name` (sse.head_of: `event: <name>` and `data: `, or `data: ` for no name), and its
 * `at` a slot. Such an event's new payload is not framed into new raw bytes: `wire`
 * writes its head, payload and blank line as parts. */
static int plain_head(PyObject *event, const char *raw, Py_ssize_t at, PyObject *name) {
    if (!slot_offset(&event_at, Py_TYPE(event)))
        return 0; /* (its `at` cannot be set to -1 here) */
    if (name == Py_None)
        return at == 6 && memcmp(raw, "data: ", 6) == 0;
    if (!PyUnicode_CheckExact(name) || !PyUnicode_IS_COMPACT_ASCII(name))
        return 0;
    Py_ssize_t n = PyUnicode_GET_LENGTH(name);
    const char *chars = (const char *)PyUnicode_DATA(name);
    return at == 14 + n && memchr(chars, '\n', (size_t)n) == NULL
           && memcmp(raw, "event: ", 7) == 0 && memcmp(raw + 7, chars, (size_t)n) == 0
           && memcmp(raw + 7 + n, "\ndata: ", 7) == 0;
}

/* The pieces spliced into a pending event, in order. */
typedef struct {
    const char *bytes[10];
    Py_ssize_t sizes[10];
    int count;
    char number[32]; /* created_at's digits */
} Pieces;

static void add(Pieces *pieces, const char *bytes, Py_ssize_t size) {
    pieces->bytes[pieces->count] = bytes;
    pieces->sizes[pieces->count] = size;
    pieces->count++;
}

/* `"created_at":<value>,` (0: not an int that fits). */
static int add_created_at(Pieces *pieces, PyObject *value) {
    if (!PyLong_CheckExact(value)) {
        return 0;
    }
    int overflow = 0;
    long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (number == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    char *end = pieces->number + sizeof(pieces->number);
    char *at = end;
    *--at = ',';
    unsigned long long magnitude =
        number < 0 ? 0ULL - (unsigned long long)number : (unsigned long long)number;
    do {
        *--at = (char)('0' + magnitude % 10);
        magnitude /= 10;
    } while (magnitude);
    if (number < 0) {
        *--at = '-';
    }
    add(pieces, "\"created_at\":", 13);
    add(pieces, at, end - at);
    return 1;
}

/* The members a pending event of the shape `seen` gets from the Envelope's own for it
 * (`_inserts`, which the Python path keeps): 1 with them added to `pieces` (their tuple
 * held in `*held`), 0 when it keeps none for the shape, 2 when they are not all inserted
 * at one place (the Python path decides), -1 with an exception set. */
static COLD int inserted_members(EnvelopeState *env, PyObject *seen, Pieces *pieces,
                                 PyObject **held) {
    PyObject *inserts = Py_NewRef(env->inserts), *members;
    PyObject *key = slot_get(&seen_members, seen);
    int done = -1;
    if (key != NULL) {
        members = PyDict_GetItemWithError(inserts, key);
        if (members == NULL)
            done = PyErr_Occurred() ? -1 : 0;
        else if (!PyTuple_CheckExact(members) || PyTuple_GET_SIZE(members) != 3)
            done = 2;
        else {
            done = 1;
            for (int i = 0; i < 3; i++)
                if (!PyBytes_CheckExact(PyTuple_GET_ITEM(members, i)))
                    done = 2;
            if (done == 1) {
                *held = Py_NewRef(members);
                for (int i = 0; i < 3; i++) {
                    PyObject *part = PyTuple_GET_ITEM(members, i);
                    add(pieces, PyBytes_AS_STRING(part), PyBytes_GET_SIZE(part));
                }
            }
        }
        Py_DECREF(key);
    }
    Py_DECREF(inserts);
    return done;
}

/* The request's fills (`Envelope._shared_fill`'s family) when the Envelope has not found
 * them yet: as `quick_family` finds them (`*found` set: kept once the event is done), else
 * the Python way (`_shared_family`, which keeps them). A new reference, NULL on error. */
static Py_NO_INLINE PyObject *pending_family(EnvelopeState *env, PyObject *last_fills,
                                             PyObject *from_request, int *found) {
    PyObject *served = Py_NewRef(env->served_models); /* (set: checked by the caller) */
    PyObject *family = quick_family(env, served, last_fills, from_request);
    Py_DECREF(served);
    if (family != Py_None) {
        *found = family != NULL;
        return family;
    }
    Py_DECREF(family); /* (not the last request's) */
    return PyObject_CallMethodNoArgs((PyObject *)env, s__shared_family);
}

/* `"conversation":{"id":"…"},` for the usual echo `{"id": …}` (its id held in `*held`): 1,
 * else 0 (the Python path), -1 with an exception set. */
static COLD int add_conversation(Pieces *pieces, PyObject *echo_value, PyObject **held) {
    PyObject *id;
    const char *chars;
    Py_ssize_t length;
    if (!PyDict_CheckExact(echo_value) || PyDict_GET_SIZE(echo_value) != 1
        || (id = PyDict_GetItemWithError(echo_value, s_id)) == NULL)
        return PyErr_Occurred() ? -1 : 0;
    *held = Py_NewRef(id);
    if (!plain_ascii(id, &chars, &length))
        return 0;
    add(pieces, "\"conversation\":{\"id\":\"", 22);
    add(pieces, chars, length);
    add(pieces, "\"},", 3);
    return 1;
}

/* Whether `size` bytes are all ASCII digits. */
static int all_digits(const char *bytes, Py_ssize_t size) {
    for (Py_ssize_t i = 0; i < size; i++)
        if (bytes[i] < '0' || bytes[i] > '9')
            return 0;
    return 1;
}

/* pending_event(envelope, event, lasts, last_fills, from_request): a pending event of the
 * shape its name was last seen in (`lasts`: envelope._KEPT.lasts) completed in place, its
 * members spliced into its data (and its raw bytes unless `plain_head`): the event, or
 * None when the case is not this one's (the Python path runs). The members are the
 * envelope's for the shape (`_inserts`), else the shape's memo (`_Seen.memo`) when it was
 * worked out for a request with the same fills (`_family`, else found as `quick_family`
 * finds it: `last_fills`, `from_request`: envelope._KEPT.last_fills, _FROM_REQUEST) and
 * echo. Relies on Event's invariant: `at` >= 0
 * means `raw` is a head, then `data`, then a blank line. Its usual path (a memo, the fills
 * found) holds only what Python code may free meanwhile (a lookup's comparison, finding the
 * fills): the rest is read where it is, each reference a line of code a call misses. */
static PyObject *pending_event(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "pending_event() takes 5 arguments");
        return NULL;
    }
    PyObject *event = args[1], *lasts = args[2];
    if (!PyDict_CheckExact(lasts)
        || !subtype_of((PyObject *)Py_TYPE(args[0]), &EnvelopeState_Type, &envelope_type)
        || !event_slots(event)) {
        Py_RETURN_NONE;
    }
    EnvelopeState *env = (EnvelopeState *)args[0]; /* (its members read in place) */
    /* (held: the shape, the event's bytes, the memo, the fills when found here, the echo,
     * and what else the members are read from) */
    PyObject *last, *raw = NULL, *memo = NULL, *family = NULL, *echo = NULL, *held = NULL;
    PyObject *result = Py_None, *spliced, *data;
    int family_found = 0, kept;
    Pieces pieces;
    pieces.count = 0;
    const char *chars;
    Py_ssize_t length;

    PyObject *name = slot_get(&event_name, event);
    if (name == NULL) {
        return NULL;
    }
    last = PyDict_GetItemWithError(lasts, name);
    Py_XINCREF(last);
    if (last == NULL) {
        Py_DECREF(name);
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    }
    /* (prefix, n, middle, digits, suffix, cut, at, seen): see envelope._remember_last */
    if (!PyTuple_CheckExact(last) || PyTuple_GET_SIZE(last) != 8) {
        goto done;
    }
    PyObject *prefix = PyTuple_GET_ITEM(last, 0), *middle = PyTuple_GET_ITEM(last, 2);
    PyObject *suffix = PyTuple_GET_ITEM(last, 4), *insert_at = PyTuple_GET_ITEM(last, 6);
    PyObject *seen = PyTuple_GET_ITEM(last, 7);
    if (!PyBytes_CheckExact(prefix) || !PyBytes_CheckExact(middle) || !PyBytes_CheckExact(suffix)
        || !PyLong_CheckExact(insert_at)) {
        goto done;
    }
    if ((raw = slot_get(&event_raw, event)) == NULL) {
        goto error;
    }
    PyObject *at_object = slot_get(&event_at, event);
    if (at_object == NULL) {
        goto error;
    }
    Py_ssize_t at = PyLong_CheckExact(at_object) ? PyLong_AsSsize_t(at_object) : -1;
    Py_DECREF(at_object); /* (an int's release runs no Python code) */
    Py_ssize_t insert = PyLong_AsSsize_t(insert_at);
    if (at == -1 || insert == -1) {
        PyErr_Clear();
        goto done;
    }
    if (!PyBytes_CheckExact(raw)) {
        goto done;
    }
    Py_ssize_t raw_size = PyBytes_GET_SIZE(raw);
    if (at < 0 || raw_size - 2 < at) {
        goto done;
    }
    /* The shape, checked on the event's data (raw[at:-2]): the bytes around the id's
     * value and created_at's digits are those it was last seen with. */
    const char *bytes = PyBytes_AS_STRING(raw) + at;
    Py_ssize_t size = raw_size - 2 - at;
    Py_ssize_t n = PyBytes_GET_SIZE(prefix), m = PyBytes_GET_SIZE(middle);
    Py_ssize_t s = PyBytes_GET_SIZE(suffix);
    if (n > size || memcmp(bytes, PyBytes_AS_STRING(prefix), n) != 0) {
        goto done;
    }
    const char *quote = memchr(bytes + n, '"', size - n);
    if (quote == NULL) {
        goto done;
    }
    Py_ssize_t digits = (quote - bytes) + m; /* where created_at's digits begin */
    Py_ssize_t cut = size - s;               /* and end */
    if (m == 0 || s == 0 || digits >= cut || insert <= 0 || insert > size
        || memcmp(quote, PyBytes_AS_STRING(middle), m) != 0
        || memcmp(bytes + cut, PyBytes_AS_STRING(suffix), s) != 0
        || !all_digits(bytes + digits, cut - digits)) {
        goto done;
    }

    /* The members: the envelope's for this shape, else the shape's memo. */
    if (env->inserts == NULL) {
        goto done; /* (deleted: the Python's) */
    }
    if (PyDict_CheckExact(env->inserts)) {
        kept = inserted_members(env, seen, &pieces, &held);
        if (kept < 0) {
            goto error;
        }
        if (kept == 2) {
            goto done;
        }
        if (kept == 1) {
            goto splice;
        }
    }
    /* (the request's fills, echo's name, created_at?, previous id?, shared bytes,
     * conversation?) */
    if ((memo = slot_get(&seen_memo, seen)) == NULL) {
        goto error;
    }
    if (!PyTuple_CheckExact(memo) || PyTuple_GET_SIZE(memo) != 6
        || !PyBytes_CheckExact(PyTuple_GET_ITEM(memo, 4)) || env->served_models == NULL
        || env->family == NULL) {
        goto done; /* (one deleted: the Python's) */
    }
    /* The fills this request's members decide (`Envelope._shared_fill`'s family): the
     * memo's are the same object only for the same values of them. */
    if (env->family == Py_None) {
        family = pending_family(env, args[3], args[4], &family_found);
        if (family == NULL) {
            goto error;
        }
    } else {
        family = Py_NewRef(env->family);
    }
    /* (no Python code runs from here on: the Envelope's members are read as they are now) */
    if (family != PyTuple_GET_ITEM(memo, 0) || !PyDict_CheckExact(family)
        || env->pinned != Py_None || env->echo == NULL || env->created_at == NULL) {
        goto done; /* (pinned members, or one deleted: the Python's) */
    }
    echo = Py_NewRef(env->echo);
    PyObject *echo_name = Py_None, *echo_value = Py_None;
    if (echo != Py_None) {
        if (!PyTuple_CheckExact(echo) || PyTuple_GET_SIZE(echo) != 2) {
            goto done;
        }
        echo_name = PyTuple_GET_ITEM(echo, 0);
        echo_value = PyTuple_GET_ITEM(echo, 1);
    }
    PyObject *memo_echo = PyTuple_GET_ITEM(memo, 1);
    if (echo_name != memo_echo
        && (!PyUnicode_CheckExact(echo_name) || !PyUnicode_CheckExact(memo_echo)
            || !same_str(echo_name, memo_echo))) {
        goto done;
    }
    int previous = is_str(echo_name, s_previous_response_id);
    if (PyTuple_GET_ITEM(memo, 2) == Py_True && !add_created_at(&pieces, env->created_at)) {
        goto done; /* (not known yet: the Python path takes the time) */
    }
    if (PyTuple_GET_ITEM(memo, 3) == Py_True) {
        if (!previous) {
            add(&pieces, "\"previous_response_id\":null,", 28);
        } else if (plain_ascii(echo_value, &chars, &length)) {
            add(&pieces, "\"previous_response_id\":\"", 24);
            add(&pieces, chars, length);
            add(&pieces, "\",", 2);
        } else {
            goto done;
        }
    }
    PyObject *shared = PyTuple_GET_ITEM(memo, 4);
    add(&pieces, PyBytes_AS_STRING(shared), PyBytes_GET_SIZE(shared));
    if (PyTuple_GET_ITEM(memo, 5) == Py_True) {
        /* (at most 9 pieces: created_at 2, previous 3, shared 1, conversation 3) */
        kept = previous ? 0 : add_conversation(&pieces, echo_value, &held);
        if (kept <= 0) {
            if (kept < 0) {
                goto error;
            }
            goto done;
        }
    }

    Py_ssize_t total;
splice: /* raw[:at + insert], the members, raw[at + insert:]: one allocation, and the data. */
    total = raw_size;
    for (int i = 0; i < pieces.count; i++) {
        if (pieces.sizes[i] > PY_SSIZE_T_MAX - total) {
            goto done;
        }
        total += pieces.sizes[i];
    }
    if (total == raw_size) {
        goto done; /* (nothing to insert: the Python path decides) */
    }
    /* An event framed plainly gets its new data only (`wire` frames it), else its raw
     * bytes are spliced too and the data is their copy. */
    int plain = plain_head(event, PyBytes_AS_STRING(raw), at, name);
    Py_ssize_t from = plain ? at : 0, to = plain ? raw_size - 2 : raw_size;
    if ((spliced = PyBytes_FromStringAndSize(NULL, total - (raw_size - (to - from)))) == NULL) {
        goto error;
    }
    char *out = PyBytes_AS_STRING(spliced);
    Py_ssize_t head = at + insert;
    memcpy(out, PyBytes_AS_STRING(raw) + from, head - from);
    out += head - from;
    for (int i = 0; i < pieces.count; i++) {
        memcpy(out, pieces.bytes[i], pieces.sizes[i]);
        out += pieces.sizes[i];
    }
    memcpy(out, PyBytes_AS_STRING(raw) + head, to - head);
    if (plain) {
        data = spliced;
        spliced = Py_NewRef(no_bytes);
    } else {
        data = PyBytes_FromStringAndSize(PyBytes_AS_STRING(spliced) + at, total - 2 - at);
    }
    if (data == NULL || set_event(event, spliced, data, plain ? minus_one : NULL) < 0) {
        Py_DECREF(spliced);
        Py_XDECREF(data);
        goto error;
    }
    Py_DECREF(spliced);
    Py_DECREF(data);
    if (family_found) { /* (as `Envelope._shared_fill` keeps it) */
        Py_XSETREF(env->family, Py_NewRef(family));
    }
    result = event;
    goto done;
error:
    result = NULL;
done:
    Py_XINCREF(result);
    Py_DECREF(name);
    Py_DECREF(last);
    Py_XDECREF(raw);
    Py_XDECREF(memo);
    Py_XDECREF(family);
    Py_XDECREF(echo);
    Py_XDECREF(held);
    return result;
}

/* ---- Envelope.terminal_event ---------------------------------------------------- */

static Slot plan_fast_slot = {&s_fast}, fill_fast_slot = {&s_fast};

static PyObject *fast_of_plan(PyObject *plan) {
    return slot_get(&plan_fast_slot, plan);
}

static PyObject *fast_of_fill(PyObject *fill) {
    return slot_get(&fill_fast_slot, fill);
}

/* Where a terminal event's Response is in its data (`_response_span`), or 0. */
static int response_span(const char *data, Py_ssize_t len, PyObject *layout, long long seq,
                         Py_ssize_t *start, Py_ssize_t *end) {
    PyObject *head = item_of(layout, 0), *sdk_tail = item_of(layout, 2);
    if (sdk_tail == NULL || !PyBytes_CheckExact(head) || !PyBytes_CheckExact(sdk_tail))
        return 0;
    char number[24];
    int width = digits(number, seq);
    /* The tail after the Response: `,"sequence_number":N}` or the SDK's order's. */
    const char *before, *after;
    Py_ssize_t before_len, after_len;
    Py_ssize_t head_len = PyBytes_GET_SIZE(head);
    if (len >= head_len && memcmp(data, PyBytes_AS_STRING(head), (size_t)head_len) == 0) {
        *start = head_len;
        before = ",\"sequence_number\":";
        before_len = 19;
        after = "}";
        after_len = 1;
    } else if (len >= 12 && memcmp(data, "{\"response\":", 12) == 0) {
        *start = 12;
        const char *tail = PyBytes_AS_STRING(sdk_tail);
        Py_ssize_t tail_len = PyBytes_GET_SIZE(sdk_tail);
        const char *mark = NULL;
        for (Py_ssize_t i = 0; i + 1 < tail_len; i++)
            if (tail[i] == '%' && tail[i + 1] == 'd') {
                mark = tail + i;
                break;
            }
        if (mark == NULL || memchr(tail, '%', (size_t)(mark - tail)) != NULL
            || memchr(mark + 2, '%', (size_t)(tail + tail_len - mark - 2)) != NULL)
            return 0;
        before = tail;
        before_len = mark - tail;
        after = mark + 2;
        after_len = tail + tail_len - after;
    } else
        return 0;
    Py_ssize_t tail_len = before_len + width + after_len;
    *end = len - tail_len;
    if (*end - *start < 3)
        return 0;
    const char *tail = data + *end;
    if (memcmp(tail, before, (size_t)before_len) != 0
        || memcmp(tail + before_len, number, (size_t)width) != 0
        || memcmp(tail + before_len + width, after, (size_t)after_len) != 0)
        return 0;
    return data[*start] == '{' && data[*end - 1] == '}';
}

/* A terminal event's payload as a backend writes it: its Response, type and number. */
static Keys payload_keys = {.count = 3, .names = {&s_response, &s_type, &s_sequence_number}};

/* terminal_event(envelope, event, payload, last_answer, last_fills, from_request, Patch,
 * layouts): Envelope.terminal_event for the usual event (its Response found at once, its
 * items complete, its bytes framed as usual): (the patch, (the stored bytes, True)), the
 * event's bytes changed in place; or None. */
static PyObject *terminal_event(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (UNLIKELY(nargs != 8)) {
        PyErr_SetString(PyExc_TypeError, "terminal_event() takes 8 arguments");
        return NULL;
    }
    PyObject *env = args[0], *event = args[1], *payload = args[2], *layouts = args[7];
    PyObject *data = NULL, *raw = NULL, *at_obj = NULL, *stored = NULL, *new_data = NULL,
             *new_raw = NULL, *name = NULL, *result = NULL, *v[3];
    if (UNLIKELY(!PyDict_CheckExact(payload) || PyDict_GET_SIZE(payload) != 3
                 || !PyDict_CheckExact(layouts) || !event_slots(event)))
        Py_RETURN_NONE;
    /* (response, type, sequence_number), each held: a lookup may run a key's __eq__ */
    if (LIKELY(known_values(payload, &payload_keys, v))) { /* (no Python code runs) */
        for (int i = 0; i < 3; i++)
            Py_INCREF(v[i]);
    } else {
        int found = 0;
        Py_INCREF(payload);
        for (; found < 3; found++) {
            v[found] = Py_XNewRef(PyDict_GetItemWithError(payload, *payload_keys.names[found]));
            if (v[found] == NULL)
                break;
        }
        if (found == 3)
            learn(payload, &payload_keys);
        Py_DECREF(payload);
        if (found < 3) {
            for (int i = 0; i < found; i++)
                Py_DECREF(v[i]);
            if (PyErr_Occurred())
                return NULL;
            Py_RETURN_NONE;
        }
    }
    PyObject *response = v[0], *kind = v[1], *seq = v[2], *layout = NULL;
    if (UNLIKELY(!PyDict_CheckExact(response) || !PyUnicode_CheckExact(kind)
                 || !PyLong_CheckExact(seq)))
        goto decline;
    /* Looked up by the event's name when it is the same str: the stream has hashed that
     * one already (the payload's is new, its hash not worked out yet). */
    if (UNLIKELY((name = slot_get(&event_name, event)) == NULL))
        goto done;
    PyObject *key = kind;
    if (PyUnicode_CheckExact(name) && same_str(name, kind))
        key = name;
    if (UNLIKELY((layout = PyDict_GetItemWithError(layouts, key)) == NULL)) {
        if (PyErr_Occurred())
            goto done;
        goto decline;
    }
    Py_INCREF(layout); /* (an event's attribute read may run Python code) */
    int overflow;
    long long number = PyLong_AsLongLongAndOverflow(seq, &overflow);
    if (UNLIKELY(overflow || (number == -1 && PyErr_Occurred()))) {
        PyErr_Clear();
        goto decline;
    }
    if (UNLIKELY((data = slot_get(&event_data, event)) == NULL
                 || (raw = slot_get(&event_raw, event)) == NULL
                 || (at_obj = slot_get(&event_at, event)) == NULL))
        goto done;
    Py_ssize_t at = PyLong_CheckExact(at_obj) ? PyLong_AsSsize_t(at_obj) : -1;
    if (UNLIKELY(at == -1 && PyErr_Occurred()))
        PyErr_Clear();
    Py_ssize_t start, end;
    if (UNLIKELY(!PyBytes_CheckExact(data) || !PyBytes_CheckExact(raw) || at < 0
                 || at > PyBytes_GET_SIZE(raw)
                 || !response_span(PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), layout,
                                   number, &start, &end))) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    AnswerArgs in = {env, response, args[3], args[4], args[5], args[6], end - start};
    Answer a;
    int answered = answer_members(&in, &a);
    if (UNLIKELY(answered <= 0)) {
        if (answered == 0)
            result = Py_NewRef(Py_None);
        goto done;
    }
    const char *given = PyBytes_AS_STRING(data) + start;
    Py_ssize_t given_len = end - start, len = PyBytes_GET_SIZE(data);
    if (a.count == 0)
        stored = PyBytes_FromStringAndSize(given, given_len);
    else {
        Py_ssize_t members = answer_len(&a), stored_len = given_len + 1 + members;
        int plain = plain_head(event, PyBytes_AS_STRING(raw), at, name);
        stored = PyBytes_FromStringAndSize(NULL, stored_len);
        new_data = PyBytes_FromStringAndSize(NULL, len + 1 + members);
        new_raw = plain ? Py_NewRef(no_bytes)
                        : PyBytes_FromStringAndSize(NULL, at + len + 1 + members + 2);
        if (UNLIKELY(stored == NULL || new_data == NULL || new_raw == NULL)) {
            answer_clear(&a);
            goto done;
        }
        char *to = PyBytes_AS_STRING(stored);
        memcpy(to, given, (size_t)(given_len - 1));
        to += given_len - 1;
        *to++ = ',';
        to = answer_write(&a, to);
        *to = '}';
        to = PyBytes_AS_STRING(new_data);
        memcpy(to, PyBytes_AS_STRING(data), (size_t)start);
        memcpy(to + start, PyBytes_AS_STRING(stored), (size_t)stored_len);
        memcpy(to + start + stored_len, PyBytes_AS_STRING(data) + end, (size_t)(len - end));
        if (!plain) {
            to = PyBytes_AS_STRING(new_raw);
            memcpy(to, PyBytes_AS_STRING(raw), (size_t)at);
            memcpy(to + at, PyBytes_AS_STRING(new_data), (size_t)PyBytes_GET_SIZE(new_data));
            memcpy(to + at + PyBytes_GET_SIZE(new_data), "\n\n", 2);
        }
        if (UNLIKELY(set_event(event, new_raw, new_data, plain ? minus_one : NULL) < 0)) {
            answer_clear(&a);
            goto done;
        }
    }
    if (stored != NULL) {
        PyObject *in_bytes = pair(stored, Py_True);
        if (in_bytes != NULL) {
            result = pair(a.patch, in_bytes);
            Py_DECREF(in_bytes);
        }
    }
    answer_clear(&a);
    goto done;
decline:
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(response);
    Py_DECREF(kind);
    Py_DECREF(seq);
    Py_XDECREF(name);
    Py_XDECREF(layout);
    Py_XDECREF(data);
    Py_XDECREF(raw);
    Py_XDECREF(at_obj);
    Py_XDECREF(stored);
    Py_XDECREF(new_data);
    Py_XDECREF(new_raw);
    return result;
}

/* ---- sse.wire: a batch of events' bytes as parts ------------------------------------ */

/* sse.head_of's cache (None: b"data: "), b"\n\n", and b"\r\n" (a chunk's end) */
static PyObject *heads, *blank_line, *chunk_end;

/* The head written before the payload of an event named `name` (a new reference):
 * `event: <name>` and `data: `, as sse.head_of makes it (kept for a few ASCII names). */
static PyObject *head_for(PyObject *name) {
    PyObject *head = PyDict_GetItemWithError(heads, name);
    if (head != NULL)
        return Py_NewRef(head);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t n;
    const char *chars = PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, &n) : NULL;
    if (chars == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "an event's name is a str or None");
        return NULL;
    }
    if ((head = PyBytes_FromStringAndSize(NULL, 14 + n)) == NULL)
        return NULL;
    char *out = PyBytes_AS_STRING(head);
    memcpy(out, "event: ", 7);
    memcpy(out + 7, chars, (size_t)n);
    memcpy(out + 7 + n, "\ndata: ", 7);
    if (PyUnicode_IS_ASCII(name) && memchr(chars, '\n', (size_t)n) == NULL
        && PyDict_GET_SIZE(heads) < 64 && PyDict_SetItem(heads, name, head) < 0)
        Py_CLEAR(head);
    return head;
}

/* wire(events, chunked): sse._wire, the events' bytes as parts to write: each one's raw
 * bytes, or for one with none (its payload rewritten), its head, payload and blank line;
 * `chunked`: framed as one chunk of a chunked body (h1.chunk) too. */
static PyObject *wire(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "wire() takes a list of events and a bool");
        return NULL;
    }
    PyObject *events = args[0];
    int chunked = PyObject_IsTrue(args[1]);
    if (chunked < 0)
        return NULL;
    /* The parts, held (reading an event may run Python code, which may change the list),
     * counted and sized before the list is made: an event's raw bytes, or its head,
     * payload and blank line. */
    Py_ssize_t n = PyList_GET_SIZE(events), size = 0, count = 0;
    PyObject **held = PyMem_New(PyObject *, 3 * n + 1), *parts = NULL;
    if (held == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n && i < PyList_GET_SIZE(events); i++) {
        PyObject *event = Py_NewRef(PyList_GET_ITEM(events, i)), *name, *part;
        part = slot_get(&event_raw, event);
        if (part != NULL && PyBytes_CheckExact(part) && PyBytes_GET_SIZE(part) == 0) {
            Py_SETREF(part, NULL);
            if ((name = slot_get(&event_name, event)) != NULL) {
                part = head_for(name);
                Py_DECREF(name);
            }
            if (part != NULL) {
                held[count++] = part;
                if ((part = slot_get(&event_data, event)) != NULL) {
                    held[count++] = part;
                    part = Py_NewRef(blank_line);
                }
            }
        }
        Py_DECREF(event);
        if (part == NULL)
            goto done;
        held[count++] = part;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        size += PyBytes_Check(held[i]) ? PyBytes_GET_SIZE(held[i]) : 0;
    if ((parts = PyList_New(count + (chunked ? 2 : 0))) == NULL)
        goto done;
    Py_ssize_t at = 0;
    if (chunked) {
        char line[32];
        int len = snprintf(line, sizeof(line), "%zx\r\n", (size_t)size);
        PyObject *head = PyBytes_FromStringAndSize(line, len);
        if (head == NULL) {
            Py_CLEAR(parts);
            goto done;
        }
        PyList_SET_ITEM(parts, at++, head);
        PyList_SET_ITEM(parts, count + 1, Py_NewRef(chunk_end));
    }
    for (Py_ssize_t i = 0; i < count; i++)
        PyList_SET_ITEM(parts, at++, Py_NewRef(held[i]));
done:
    for (Py_ssize_t i = 0; i < count; i++)
        Py_DECREF(held[i]);
    PyMem_Free(held);
    return parts;
}

/* ---- the store's cut of a turn's response ----------------------------------------- */

/* cut(data, at, part, span): `data` without `part`, which it holds at `at` (an empty
 * `part`: nothing there to cut), and without `span`, (start, length) or None, which must
 * not overlap it (not checked byte for byte: the caller found the output there); or None
 * when `part` is not at `at` (store/local/store.py's _cut_bytes, one allocation). */
static PyObject *cut(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "cut() takes 4 arguments");
        return NULL;
    }
    PyObject *data = args[0], *part = args[2], *span = args[3];
    if (!PyBytes_Check(data) || !PyBytes_Check(part) || !PyLong_Check(args[1])
        || (span != Py_None && !(PyTuple_Check(span) && PyTuple_GET_SIZE(span) == 2))) {
        PyErr_SetString(PyExc_TypeError, "cut() takes bytes, an int, bytes and a pair or None");
        return NULL;
    }
    Py_ssize_t len = PyBytes_GET_SIZE(data), n = PyBytes_GET_SIZE(part);
    Py_ssize_t at = n ? PyLong_AsSsize_t(args[1]) : 0;
    if (at == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    const char *from = PyBytes_AS_STRING(data);
    if (n && (at < 0 || at > len - n || memcmp(from + at, PyBytes_AS_STRING(part), (size_t)n)))
        Py_RETURN_NONE;
    /* The two runs to leave out, in order: (at, n) and the span. */
    Py_ssize_t runs[2][2] = {{at, n}, {len, 0}};
    if (span != Py_None) {
        Py_ssize_t start = PyLong_AsSsize_t(PyTuple_GET_ITEM(span, 0)),
                   length = PyLong_AsSsize_t(PyTuple_GET_ITEM(span, 1));
        if ((start == -1 || length == -1) && PyErr_Occurred())
            return NULL;
        if (start < 0 || length < 0 || start > len - length
            || (n && start < at + n && at < start + length)) {
            PyErr_SetString(PyExc_ValueError, "cut(): the span is not in the data, or overlaps");
            return NULL;
        }
        runs[1][0] = start;
        runs[1][1] = length;
        if (start + length <= at) { /* (the span first) */
            runs[1][0] = at;
            runs[1][1] = n;
            runs[0][0] = start;
            runs[0][1] = length;
        }
    }
    if (runs[0][1] == 0 && runs[1][1] == 0 && PyBytes_CheckExact(data))
        return Py_NewRef(data);
    PyObject *kept = PyBytes_FromStringAndSize(NULL, len - runs[0][1] - runs[1][1]);
    if (kept != NULL) {
        char *to = PyBytes_AS_STRING(kept);
        Py_ssize_t was = 0;
        for (int i = 0; i < 2; i++) {
            memcpy(to, from + was, (size_t)(runs[i][0] - was));
            to += runs[i][0] - was;
            was = runs[i][0] + runs[i][1];
        }
        memcpy(to, from + was, (size_t)(len - was));
    }
    return kept;
}

/* ---- Envelope's methods, without a Python frame --------------------------------------
 * What envelope.py keeps past a request (`_KEPT`: the last valid answer's shape and plan,
 * the last request's fills, the pending shapes by name) and the constants the calls above
 * take with it, in one object this module makes and holds: read here at their offsets,
 * as the methods of EnvelopeState below are called, where a module's globals would each
 * be a dict lookup. Each member is unset until envelope.py sets it. */
typedef struct {
    PyObject_HEAD
    PyObject *last_answer, *last_fills, *lasts, *from_request, *patch, *layouts;
} Kept;

static int kept_traverse(Kept *self, visitproc visit, void *arg) {
    return visit_fields(FIELDS(self, last_answer, layouts), visit, arg);
}

static int kept_clear(Kept *self) {
    return clear_fields(FIELDS(self, last_answer, layouts));
}

static void kept_dealloc(Kept *self) {
    PyObject_GC_UnTrack(self);
    kept_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef kept_members[] = {
    MEMBER(Kept, last_answer, "last_answer") MEMBER(Kept, last_fills, "last_fills")
    MEMBER(Kept, lasts, "lasts") MEMBER(Kept, from_request, "from_request")
    MEMBER(Kept, patch, "patch") MEMBER(Kept, layouts, "layouts")
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject Kept_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ocxproxy._speedups.Kept",
    .tp_basicsize = sizeof(Kept),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "What continuation/envelope.py keeps past a request, as a C struct.",
    .tp_traverse = (traverseproc)kept_traverse,
    .tp_clear = (inquiry)kept_clear,
    .tp_dealloc = (destructor)kept_dealloc,
    .tp_members = kept_members,
};

static Kept *kept; /* (the module's `kept`: one for the process) */

/* The Python method `name` of `self` called with `args`: what a method below falls back
 * to when its case is not the usual one (the Python stays the reference). */
static COLD PyObject *python_method(PyObject *name, PyObject *self, PyObject *const *args,
                               Py_ssize_t nargs) {
    PyObject *stack[4];
    if (nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "too many arguments");
        return NULL;
    }
    stack[0] = self;
    for (Py_ssize_t i = 0; i < nargs; i++)
        stack[i + 1] = args[i];
    return PyObject_VectorcallMethod(name, stack, (size_t)nargs + 1, NULL);
}

/* `call` on `in` (the method's own arguments, then the kept members named by `which`,
 * each held meanwhile: Python code a comparison runs may set others in their place),
 * else, when it declines (None) or a member is unset, the Python method `name`. */
static PyObject *kept_call(PyObject *(*call)(PyObject *, PyObject *const *, Py_ssize_t),
                           PyObject *name, PyObject *self, PyObject *const *args,
                           Py_ssize_t nargs, Py_ssize_t own, PyObject *const *which,
                           Py_ssize_t count) {
    PyObject *in[8];
    if (nargs == own) {
        Py_ssize_t n = 0;
        in[n++] = self;
        for (Py_ssize_t i = 0; i < own; i++)
            in[n++] = args[i];
        for (Py_ssize_t i = 0; i < count; i++) {
            if (UNLIKELY(which[i] == NULL))
                return python_method(name, self, args, nargs);
            in[n++] = which[i];
        }
        for (Py_ssize_t i = own + 1; i < n; i++)
            Py_INCREF(in[i]);
        PyObject *done = call(NULL, in, n);
        for (Py_ssize_t i = own + 1; i < n; i++)
            Py_DECREF(in[i]);
        if (LIKELY(done != Py_None))
            return done; /* (or NULL: an error) */
        Py_DECREF(done);
    }
    return python_method(name, self, args, nargs);
}

/* Envelope.answer(data, response): `answer` above on what is kept, else `_answer`. */
static PyObject *envelope_answer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *which[] = {kept->last_answer, kept->last_fills, kept->from_request, kept->patch};
    return kept_call(answer, s__answer, self, args, nargs, 2, which, 4);
}

/* Envelope.terminal_event(event, payload): `terminal_event` above, else `_terminal_event`. */
static PyObject *envelope_terminal_event(PyObject *self, PyObject *const *args,
                                         Py_ssize_t nargs) {
    PyObject *which[] = {kept->last_answer, kept->last_fills, kept->from_request, kept->patch,
                         kept->layouts};
    return kept_call(terminal_event, s__terminal_event, self, args, nargs, 2, which, 5);
}

/* Envelope.pending_event(event): `pending_event` above, else `_pending_event`. */
static PyObject *envelope_pending_event(PyObject *self, PyObject *const *args,
                                        Py_ssize_t nargs) {
    PyObject *which[] = {kept->lasts, kept->last_fills, kept->from_request};
    return kept_call(pending_event, s__pending_event, self, args, nargs, 1, which, 3);
}

static PyMethodDef envelope_methods[] = {
    {"answer", (PyCFunction)(void (*)(void))envelope_answer, METH_FASTCALL,
     "A JSON answer's Response completed: (the stored bytes, the patch)."},
    {"pending_event", (PyCFunction)(void (*)(void))envelope_pending_event, METH_FASTCALL,
     "A lifecycle event before the terminal one, completed."},
    {"terminal_event", (PyCFunction)(void (*)(void))envelope_terminal_event, METH_FASTCALL,
     "A terminal event's Response completed: (its patch, (its stored bytes, written) or None)."},
    {NULL, NULL, 0, NULL},
};

/* (sorted by name) */
/* vectorcall(type): `type`, a subclass of EnvelopeState, called as EnvelopeState is. */
static PyObject *vectorcall(PyObject *module, PyObject *type) {
    if (!PyType_Check(type) || !PyType_IsSubtype((PyTypeObject *)type, &EnvelopeState_Type)) {
        PyErr_SetString(PyExc_TypeError, "vectorcall() takes a subclass of EnvelopeState");
        return NULL;
    }
    ((PyTypeObject *)type)->tp_vectorcall = envelope_vectorcall;
    Py_RETURN_NONE;
}

static PyMethodDef speedups_methods[] = {
    {"answer", (PyCFunction)(void (*)(void))answer, METH_FASTCALL,
     "Envelope.answer's usual answer, or None."},
    {"cut", (PyCFunction)(void (*)(void))cut, METH_FASTCALL,
     "`data` without `part`, which it holds at `at`, and without `span`; or None."},
    {"pending_event", (PyCFunction)(void (*)(void))pending_event, METH_FASTCALL,
     "Envelope.pending_event's usual event (completed in place), or None."},
    {"terminal_event", (PyCFunction)(void (*)(void))terminal_event, METH_FASTCALL,
     "Envelope.terminal_event's usual event, or None."},
    {"wire", (PyCFunction)(void (*)(void))wire, METH_FASTCALL,
     "The events' bytes as parts to write (sse._wire)."},
    {"vectorcall", vectorcall, METH_O,
     "A subclass of EnvelopeState called as EnvelopeState is (without an argument tuple)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT, "ocxproxy._speedups", NULL, -1, speedups_methods,
};

static int intern(PyObject **slot, const char *name) {
    *slot = PyUnicode_InternFromString(name);
    return *slot == NULL ? -1 : 0;
}

PyMODINIT_FUNC PyInit__speedups(void) {
    if (intern(&s__answer, "_answer") || intern(&s__pending_event, "_pending_event")
        || intern(&s__terminal_event, "_terminal_event")
        || intern(&s__shared_family, "_shared_family") || intern(&s__shared_fill, "_shared_fill")
        || intern(&s_annotations, "annotations") || intern(&s_at, "at")
        || intern(&s_cached_tokens, "cached_tokens") || intern(&s_completed, "completed")
        || intern(&s_completed_at, "completed_at") || intern(&s_content, "content")
        || intern(&s_created_at, "created_at") || intern(&s_data, "data")
        || intern(&s_encoded, "encoded")
        || intern(&s_fast, "fast")
        || intern(&s_input_tokens, "input_tokens")
        || intern(&s_input_tokens_details, "input_tokens_details")
        || intern(&s_id, "id") || intern(&s_members, "members") || intern(&s_memo, "memo")
        || intern(&s_message, "message") || intern(&s_name, "name")
        || intern(&s_model, "model") || intern(&s_output, "output")
        || intern(&s_output_text, "output_text") || intern(&s_output_tokens, "output_tokens")
        || intern(&s_output_tokens_details, "output_tokens_details")
        || intern(&s_previous, "previous")
        || intern(&s_previous_response_id, "previous_response_id") || intern(&s_raw, "raw")
        || intern(&s_reasoning, "reasoning") || intern(&s_reasoning_tokens, "reasoning_tokens")
        || intern(&s_response, "response") || intern(&s_sequence_number, "sequence_number")
        || intern(&s_status, "status") || intern(&s_store, "store")
        || intern(&s_total_tokens, "total_tokens")
        || intern(&s_type, "type")
        || intern(&s_usage, "usage"))
        return NULL;
    if (no_members == NULL && (no_members = PyDict_New()) == NULL)
        return NULL;
    if ((no_bytes == NULL && (no_bytes = PyBytes_FromStringAndSize(NULL, 0)) == NULL)
        || (no_items == NULL && (no_items = PyTuple_New(0)) == NULL)
        || (minus_one == NULL && (minus_one = PyLong_FromLong(-1)) == NULL)
        || (blank_line == NULL && (blank_line = PyBytes_FromString("\n\n")) == NULL)
        || (chunk_end == NULL && (chunk_end = PyBytes_FromString("\r\n")) == NULL))
        return NULL;
    if (heads == NULL) {
        PyObject *data_head = PyBytes_FromString("data: ");
        if (data_head == NULL || (heads = PyDict_New()) == NULL
            || PyDict_SetItem(heads, Py_None, data_head) < 0) {
            Py_XDECREF(data_head);
            return NULL;
        }
        Py_DECREF(data_head);
    }
    EnvelopeState_Type.tp_methods = envelope_methods; /* (defined after the calls they make) */
    if (PyType_Ready(&EnvelopeState_Type) < 0 || PyType_Ready(&PatchState_Type) < 0
        || PyType_Ready(&Kept_Type) < 0)
        return NULL;
    if (kept == NULL && (kept = (Kept *)PyType_GenericAlloc(&Kept_Type, 0)) == NULL)
        return NULL; /* (its members unset) */
    PyObject *module = PyModule_Create(&speedups_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddStringConstant(module, "SOURCE_DIGEST", SOURCE_DIGEST) < 0
        || PyModule_AddObjectRef(module, "EnvelopeState", (PyObject *)&EnvelopeState_Type) < 0
        || PyModule_AddObjectRef(module, "PatchState", (PyObject *)&PatchState_Type) < 0
        || PyModule_AddObjectRef(module, "kept", (PyObject *)kept) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
