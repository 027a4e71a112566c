/* mlfabric.scheduler.core._plan_native: schedule_to_decision's after (see _plan_native.c).

   The Python keeps ends[link][time] -> [payload ids] in dicts; here one open-addressing table
   keyed by (link's two nodes, time) holds the same lists as chains of ids, so neither the
   transfers in flight nor the planned ones cost a Python object each. Keys compare as the
   Python's dict keys do (nodes by ==, times as floats, 0.0 == -0.0). */
#include "_plan_native.h"

typedef struct {
    double start;
    Py_ssize_t i;
} Start;

static int start_cmp(const void *a, const void *b) {
    const Start *x = a, *y = b;
    if (x->start < y->start) return -1;
    if (x->start > y->start) return 1;
    return x->i < y->i ? -1 : x->i > y->i; /* stable: the schedule's order among equal starts */
}

typedef struct {
    PyObject *u, *v; /* borrowed (kept alive by the caller's transfers and busy) */
    Py_hash_t hu, hv;
    double t;
    Py_ssize_t head, tail; /* chain of ids in `Node`s, in the order they were added; -1: empty */
    char full;
} Slot;

typedef struct {
    PyObject *pid; /* borrowed */
    Py_ssize_t next;
} Node;

typedef struct {
    Slot *slots;
    Py_ssize_t cap, n;
    Node *nodes;
    Py_ssize_t nn, ncap;
} Ends;

static Py_hash_t key_hash(Py_hash_t hu, Py_hash_t hv, double t) {
    if (t == 0.0) t = 0.0; /* -0.0 is the same key */
    uint64_t bits;
    memcpy(&bits, &t, sizeof bits);
    uint64_t h = (uint64_t)hu * 1000003u ^ (uint64_t)hv;
    h = (h * 1000003u) ^ bits ^ (bits >> 29);
    return (Py_hash_t)(h ^ (h >> 31));
}

static int same_node(PyObject *a, PyObject *b) { return a == b ? 1 : PyObject_RichCompareBool(a, b, Py_EQ); }

static int ends_grow(Ends *e) {
    Py_ssize_t cap = e->cap ? 2 * e->cap : 64;
    Slot *s = PyMem_Calloc((size_t)cap, sizeof(Slot));
    if (s == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < e->cap; i++) {
        Slot *o = &e->slots[i];
        if (!o->full) continue;
        size_t j = (size_t)key_hash(o->hu, o->hv, o->t) & (size_t)(cap - 1);
        while (s[j].full) j = (j + 1) & (size_t)(cap - 1);
        s[j] = *o;
    }
    PyMem_Free(e->slots);
    e->slots = s;
    e->cap = cap;
    return 0;
}

/* the slot of (u, v, t), made empty where missing (make) or NULL; *err on error */
static Slot *ends_slot(Ends *e, PyObject *u, PyObject *v, double t, int make, int *err) {
    Py_hash_t hu = PyObject_Hash(u), hv = hu == -1 ? -1 : PyObject_Hash(v);
    *err = 0;
    if (hv == -1) {
        *err = 1;
        return NULL;
    }
    if (make && 2 * (e->n + 1) > e->cap && ends_grow(e) < 0) {
        *err = 1;
        return NULL;
    }
    if (e->cap == 0) return NULL;
    size_t mask = (size_t)(e->cap - 1), j = (size_t)key_hash(hu, hv, t) & mask;
    for (; e->slots[j].full; j = (j + 1) & mask) {
        Slot *s = &e->slots[j];
        if (s->hu != hu || s->hv != hv || s->t != t) continue;
        int a = same_node(s->u, u), b = a > 0 ? same_node(s->v, v) : a;
        if (b < 0) {
            *err = 1;
            return NULL;
        }
        if (b) return s;
    }
    if (!make) return NULL;
    Slot *s = &e->slots[j];
    *s = (Slot){u, v, hu, hv, t, -1, -1, 1};
    e->n++;
    return s;
}

/* ends[(u, v)][t].append(pid) */
static int ends_add(Ends *e, PyObject *u, PyObject *v, double t, PyObject *pid) {
    int err;
    Slot *s = ends_slot(e, u, v, t, 1, &err);
    if (s == NULL) return -1;
    if (e->nn == e->ncap) {
        Py_ssize_t cap = e->ncap ? 2 * e->ncap : 256;
        Node *nodes = PyMem_Realloc(e->nodes, (size_t)cap * sizeof(Node));
        if (nodes == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        e->nodes = nodes;
        e->ncap = cap;
    }
    e->nodes[e->nn] = (Node){pid, -1};
    if (s->tail >= 0)
        e->nodes[s->tail].next = e->nn;
    else
        s->head = e->nn;
    s->tail = e->nn++;
    return 0;
}

/* a link as its two nodes: 1, 0 (not a pair: the caller runs the Python loop), -1 */
static int pair(PyObject *link, PyObject **u, PyObject **v) {
    if (!PyTuple_Check(link) || PyTuple_GET_SIZE(link) != 2) return 0;
    *u = PyTuple_GET_ITEM(link, 0);
    *v = PyTuple_GET_ITEM(link, 1);
    return 1;
}

/* the sorted tuple of ids.get(p, p) for the distinct ids in found[0:n] other than pid */
static PyObject *after_of(PyObject **found, Py_ssize_t n, PyObject *pid, PyObject *ids) {
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        int dup = same_node(found[k], pid);
        for (Py_ssize_t q = 0; dup == 0 && q < k; q++) dup = same_node(found[q], found[k]);
        if (dup < 0) goto fail;
        if (dup) continue;
        PyObject *named = PyDict_GetItemWithError(ids, found[k]);
        if (named == NULL && PyErr_Occurred()) goto fail;
        if (PyList_Append(list, named ? named : found[k]) < 0) goto fail;
    }
    if (PyList_GET_SIZE(list) > 1 && PyList_Sort(list) < 0) goto fail;
    PyObject *out = PyList_GET_SIZE(list) ? PyList_AsTuple(list) : Py_NewRef(empty_tuple);
    Py_DECREF(list);
    return out;
fail:
    Py_DECREF(list);
    return NULL;
}

PyObject *py_follows(PyObject *self, PyObject *args) {
    PyObject *transfers, *busy, *ids, *rows = NULL;
    if (!PyArg_ParseTuple(args, "O!OO!|O!", &PyTuple_Type, &transfers, &busy, &PyDict_Type, &ids, &PyType_Type, &rows))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(transfers);
    Ends e = {NULL, 0, 0, NULL, 0, 0};
    PyObject *busy_fast = NULL, *after = NULL, *out = NULL;
    PyObject **held = PyMem_Calloc((size_t)(4 * n + 1), sizeof(PyObject *)); /* path, pid, start, end */
    Start *order = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Start));
    PyObject **found = NULL;
    Py_ssize_t nfound_cap = 0;
    if (held == NULL || order == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if ((busy_fast = PySequence_Fast(busy, "busy must be a sequence")) == NULL) goto done;
    for (Py_ssize_t b = 0; b < PySequence_Fast_GET_SIZE(busy_fast); b++) {
        PyObject *item = PySequence_Fast_GET_ITEM(busy_fast, b);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_SetString(PyExc_TypeError, "busy: (id, links, end) each");
            goto done;
        }
        PyObject *fid = PyTuple_GET_ITEM(item, 0), *links = PyTuple_GET_ITEM(item, 1);
        double end = PyFloat_AsDouble(PyTuple_GET_ITEM(item, 2));
        if (end == -1.0 && PyErr_Occurred()) goto done;
        PyObject *lf = PySequence_Fast(links, "busy: links must be a sequence");
        if (lf == NULL) goto done;
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(lf); k++) {
            PyObject *u, *v;
            int ok = pair(PySequence_Fast_GET_ITEM(lf, k), &u, &v);
            if (ok > 0) ok = ends_add(&e, u, v, end, fid) < 0 ? -1 : 1;
            if (ok <= 0) {
                Py_DECREF(lf);
                if (ok == 0) out = Py_NewRef(Py_None);
                goto done;
            }
        }
        Py_DECREF(lf);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyTuple_GET_ITEM(transfers, i);
        PyObject **h = held + 4 * i;
        if (rows != NULL && Py_TYPE(t) == (PyTypeObject *)rows && PyTuple_GET_SIZE(t) >= 6) {
            h[0] = Py_NewRef(PyTuple_GET_ITEM(t, 3)); /* a TransferTimes row: its fields by place */
            h[1] = Py_NewRef(PyTuple_GET_ITEM(t, 0));
            h[2] = Py_NewRef(PyTuple_GET_ITEM(t, 4));
            h[3] = Py_NewRef(PyTuple_GET_ITEM(t, 5));
        } else if ((h[0] = PyObject_GetAttr(t, str_path)) == NULL ||
                   (h[1] = PyObject_GetAttr(t, str_payload_id)) == NULL ||
                   (h[2] = PyObject_GetAttr(t, str_start)) == NULL || (h[3] = PyObject_GetAttr(t, str_end)) == NULL)
            goto done;
        if (!PyTuple_CheckExact(h[0])) {
            PyErr_SetString(PyExc_TypeError, "follows: a path must be a tuple");
            goto done;
        }
        order[i].start = PyFloat_AsDouble(h[2]);
        if (order[i].start == -1.0 && PyErr_Occurred()) goto done;
        order[i].i = i;
    }
    qsort(order, (size_t)n, sizeof(Start), start_cmp);
    if ((after = PyList_New(n)) == NULL) goto done;
    for (Py_ssize_t q = 0; q < n; q++) {
        Py_ssize_t i = order[q].i;
        PyObject *path = held[4 * i], *pid = held[4 * i + 1];
        Py_ssize_t nh = PyTuple_GET_SIZE(path), nf = 0;
        if (nh < 2) { /* no link (the payload is at its next hop already): follows nothing */
            PyList_SET_ITEM(after, i, Py_NewRef(empty_tuple));
            continue;
        }
        double start = order[q].start, end = PyFloat_AsDouble(held[4 * i + 3]);
        if (end == -1.0 && PyErr_Occurred()) goto done;
        for (Py_ssize_t k = 0; k + 1 < nh; k++) {
            int err;
            Slot *s = ends_slot(&e, PyTuple_GET_ITEM(path, k), PyTuple_GET_ITEM(path, k + 1), start, 0, &err);
            if (err) goto done;
            for (Py_ssize_t c = s ? s->head : -1; c >= 0; c = e.nodes[c].next) {
                if (nf == nfound_cap) {
                    Py_ssize_t cap = nfound_cap ? 2 * nfound_cap : 16;
                    PyObject **f = PyMem_Realloc(found, (size_t)cap * sizeof(PyObject *));
                    if (f == NULL) {
                        PyErr_NoMemory();
                        goto done;
                    }
                    found = f;
                    nfound_cap = cap;
                }
                found[nf++] = e.nodes[c].pid;
            }
        }
        PyObject *deps = nf ? untrack_atoms(after_of(found, nf, pid, ids)) : Py_NewRef(empty_tuple);
        if (deps == NULL) goto done;
        PyList_SET_ITEM(after, i, deps);
        for (Py_ssize_t k = 0; k + 1 < nh; k++)
            if (ends_add(&e, PyTuple_GET_ITEM(path, k), PyTuple_GET_ITEM(path, k + 1), end, pid) < 0) goto done;
    }
    out = after;
    after = NULL;
done:
    if (held != NULL)
        for (Py_ssize_t k = 0; k < 4 * n; k++) Py_XDECREF(held[k]);
    PyMem_Free(held);
    PyMem_Free(order);
    PyMem_Free(found);
    PyMem_Free(e.slots);
    PyMem_Free(e.nodes);
    Py_XDECREF(busy_fast);
    Py_XDECREF(after);
    return out;
}
