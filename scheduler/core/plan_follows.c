/* mlfabric.scheduler.core._plan_native: schedule_to_decision's after (see _plan_native.c). */
#include "_plan_native.h"

/* ------------------------------------------------------------------ convert.schedule_to_decision */


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

/* ends[link][at].append(pid), ends and ends[link] made where missing; borrowed ends[link] in *at_link */
static int add_end(PyObject *ends, PyObject *link, PyObject *at, PyObject *pid, PyObject **at_link) {
    PyObject *by = *at_link;
    if (by == NULL) {
        by = PyDict_GetItemWithError(ends, link);
        if (by == NULL) {
            if (PyErr_Occurred()) return -1;
            if ((by = PyDict_New()) == NULL) return -1;
            int rc = PyDict_SetItem(ends, link, by);
            Py_DECREF(by);
            if (rc < 0) return -1;
        }
        *at_link = by;
    }
    PyObject *got = PyDict_GetItemWithError(by, at);
    if (got == NULL) {
        if (PyErr_Occurred()) return -1;
        PyObject *list = PyList_New(1);
        if (list == NULL) return -1;
        Py_INCREF(pid);
        PyList_SET_ITEM(list, 0, pid);
        int rc = PyDict_SetItem(by, at, list);
        Py_DECREF(list);
        return rc;
    }
    return PyList_Append(got, pid);
}

PyObject *py_follows(PyObject *self, PyObject *args) {
    PyObject *transfers, *busy, *ids;
    if (!PyArg_ParseTuple(args, "O!OO!", &PyTuple_Type, &transfers, &busy, &PyDict_Type, &ids)) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(transfers);
    PyObject *ends = NULL, *after = NULL, *busy_fast = NULL, *out = NULL, *used = NULL;
    Start *order = PyMem_Malloc((n ? n : 1) * sizeof(Start));
    PyObject **at_link = NULL;
    if (order == NULL) return PyErr_NoMemory();
    if ((ends = PyDict_New()) == NULL) goto done;
    if ((busy_fast = PySequence_Fast(busy, "busy must be a sequence")) == NULL) goto done;
    /* only the links a planned transfer takes are ever looked up: the busy ends elsewhere are
       left out (many transfers in flight, few planned) */
    if ((used = PySet_New(NULL)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < n && used != NULL; i++) {
        PyObject *path = PyObject_GetAttr(PyTuple_GET_ITEM(transfers, i), str_path);
        if (path == NULL) goto done;
        if (!PyTuple_CheckExact(path)) Py_CLEAR(used); /* the loop below refuses it */
        for (Py_ssize_t k = 0; used != NULL && k + 1 < PyTuple_GET_SIZE(path); k++) {
            PyObject *link = PyTuple_Pack(2, PyTuple_GET_ITEM(path, k), PyTuple_GET_ITEM(path, k + 1));
            int rc = link == NULL ? -1 : PySet_Add(used, link);
            Py_XDECREF(link);
            if (rc < 0) {
                Py_DECREF(path);
                goto done;
            }
        }
        Py_DECREF(path);
    }
    for (Py_ssize_t b = 0; b < PySequence_Fast_GET_SIZE(busy_fast); b++) {
        PyObject *item = PySequence_Fast_GET_ITEM(busy_fast, b);
        PyObject *fid, *links, *end;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_SetString(PyExc_TypeError, "busy: (id, links, end) each");
            goto done;
        }
        fid = PyTuple_GET_ITEM(item, 0);
        links = PyTuple_GET_ITEM(item, 1);
        end = PyTuple_GET_ITEM(item, 2);
        PyObject *lf = PySequence_Fast(links, "busy: links must be a sequence");
        if (lf == NULL) goto done;
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(lf); k++) {
            PyObject *by = NULL, *link = PySequence_Fast_GET_ITEM(lf, k);
            int wanted = used == NULL ? 1 : PySet_Contains(used, link);
            if (wanted == 0) continue;
            if (wanted < 0 || add_end(ends, link, end, fid, &by) < 0) {
                Py_DECREF(lf);
                goto done;
            }
        }
        Py_DECREF(lf);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *st = PyObject_GetAttr(PyTuple_GET_ITEM(transfers, i), str_start);
        if (st == NULL) goto done;
        order[i].start = PyFloat_AsDouble(st);
        Py_DECREF(st);
        if (order[i].start == -1.0 && PyErr_Occurred()) goto done;
        order[i].i = i;
    }
    qsort(order, n, sizeof(Start), start_cmp);
    if ((after = PyList_New(n)) == NULL) goto done;
    at_link = PyMem_Malloc(MAX_LINKS * sizeof(PyObject *));
    if (at_link == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t q = 0; q < n; q++) {
        Py_ssize_t i = order[q].i;
        PyObject *t = PyTuple_GET_ITEM(transfers, i);
        PyObject *path = PyObject_GetAttr(t, str_path);
        if (path == NULL) goto done;
        if (!PyTuple_CheckExact(path)) {
            Py_DECREF(path);
            PyErr_SetString(PyExc_TypeError, "follows: a path must be a tuple");
            goto done;
        }
        Py_ssize_t nh = PyTuple_GET_SIZE(path);
        if (nh < 2) {
            Py_DECREF(path);
            Py_INCREF(empty_tuple);
            PyList_SET_ITEM(after, i, empty_tuple);
            continue;
        }
        if (nh - 1 > MAX_LINKS) {
            Py_DECREF(path);
            PyErr_SetString(PyExc_ValueError, "follows: path too long");
            goto done;
        }
        PyObject *start = PyObject_GetAttr(t, str_start);
        PyObject *pid = start == NULL ? NULL : PyObject_GetAttr(t, str_payload_id);
        PyObject *end = pid == NULL ? NULL : PyObject_GetAttr(t, str_end);
        PyObject *found = end == NULL ? NULL : PySet_New(NULL);
        int ok = found != NULL;
        for (Py_ssize_t k = 0; ok && k + 1 < nh; k++) { /* at_link = [ends[link] for link in t.links] */
            PyObject *link = PyTuple_Pack(2, PyTuple_GET_ITEM(path, k), PyTuple_GET_ITEM(path, k + 1));
            PyObject *by = NULL;
            if (link == NULL) {
                ok = 0;
                break;
            }
            by = PyDict_GetItemWithError(ends, link);
            if (by == NULL) {
                if (PyErr_Occurred() || (by = PyDict_New()) == NULL) {
                    ok = 0;
                } else {
                    ok = PyDict_SetItem(ends, link, by) == 0;
                    Py_DECREF(by);
                }
            }
            Py_DECREF(link);
            at_link[k] = by;
            if (!ok) break;
            PyObject *got = PyDict_GetItemWithError(by, start);
            if (got != NULL) {
                if (!PyList_CheckExact(got)) {
                    PyErr_SetString(PyExc_TypeError, "follows: ends must be lists");
                    ok = 0;
                }
                for (Py_ssize_t g = 0; ok && g < PyList_GET_SIZE(got); g++)
                    if (PySet_Add(found, PyList_GET_ITEM(got, g)) < 0) ok = 0;
            } else if (PyErr_Occurred()) {
                ok = 0;
            }
        }
        PyObject *deps = NULL;
        if (ok && PySet_Discard(found, pid) < 0) ok = 0;
        if (ok) {
            Py_ssize_t nf = PySet_GET_SIZE(found);
            PyObject *list = nf ? PySequence_List(found) : NULL;
            if (nf && list == NULL) ok = 0;
            for (Py_ssize_t k = 0; ok && k < nf; k++) { /* ids.get(p, p) */
                PyObject *p = PyList_GET_ITEM(list, k);
                PyObject *named = PyDict_GetItemWithError(ids, p);
                if (named == NULL && PyErr_Occurred()) {
                    ok = 0;
                } else if (named != NULL) {
                    Py_INCREF(named);
                    PyList_SetItem(list, k, named);
                }
            }
            if (ok && nf > 1 && PyList_Sort(list) < 0) ok = 0;
            if (ok) deps = nf ? PyList_AsTuple(list) : (Py_INCREF(empty_tuple), empty_tuple);
            Py_XDECREF(list);
            if (deps == NULL) ok = 0;
        }
        for (Py_ssize_t k = 0; ok && k + 1 < nh; k++) {
            PyObject *by = at_link[k];
            if (add_end(ends, NULL, end, pid, &by) < 0) ok = 0;
        }
        Py_XDECREF(path);
        Py_XDECREF(start);
        Py_XDECREF(pid);
        Py_XDECREF(end);
        Py_XDECREF(found);
        if (!ok) {
            Py_XDECREF(deps);
            goto done;
        }
        PyList_SET_ITEM(after, i, deps);
    }
    out = after;
    after = NULL;
done:
    PyMem_Free(order);
    PyMem_Free(at_link);
    Py_XDECREF(ends);
    Py_XDECREF(used);
    Py_XDECREF(busy_fast);
    Py_XDECREF(after);
    return out;
}
