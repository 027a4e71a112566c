/* mlfabric.scheduler.core._plan_native: trees._build (see _plan_native.c). */
#include "_plan_native.h"

/* ------------------------------------------------------------------ trees._build */

typedef struct {
    PyObject *top, *rank, *host_of, *prefix, *nodes, *parent, *summing, *node_cls, *node_fields;
} Sum;

static Py_ssize_t rank_of(PyObject *rank, PyObject *h) {
    PyObject *r = PyDict_GetItemWithError(rank, h);
    if (r == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, h);
        return -1;
    }
    return PyLong_AsSsize_t(r);
}

/* trees._sum: the aggregate of `members` (a list, copied) at the best host below `point`; its id */
static PyObject *sum_at(Sum *S, PyObject *point, PyObject *members) {
    PyObject *tt = PyDict_GetItemWithError(S->top, point);
    if (tt == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, point);
        return NULL;
    }
    if (!PyTuple_Check(tt) || PyTuple_GET_SIZE(tt) != 2 || !PyList_Check(PyTuple_GET_ITEM(tt, 0))) {
        PyErr_SetString(PyExc_TypeError, "build: top[x] must be (list, set)");
        return NULL;
    }
    PyObject *tier = PyTuple_GET_ITEM(tt, 0), *fastest = PyTuple_GET_ITEM(tt, 1);
    PyObject *busy = PyDict_GetItemWithError(S->summing, point);
    if (busy == NULL) {
        if (PyErr_Occurred() || (busy = PySet_New(NULL)) == NULL) return NULL;
        int rc = PyDict_SetItem(S->summing, point, busy);
        Py_DECREF(busy);
        if (rc < 0) return NULL;
    }
    PyObject *local = PySet_New(NULL);
    if (local == NULL) return NULL;
    Py_ssize_t nm = PyList_GET_SIZE(members);
    for (Py_ssize_t k = 0; k < nm; k++) {
        PyObject *h = PyDict_GetItemWithError(S->host_of, PyList_GET_ITEM(members, k));
        if (h == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, PyList_GET_ITEM(members, k));
            Py_DECREF(local);
            return NULL;
        }
        int in = PySet_Contains(fastest, h);
        if (in < 0 || (in && PySet_Add(local, h) < 0)) {
            Py_DECREF(local);
            return NULL;
        }
    }
    PyObject *agg = NULL; /* borrowed */
    Py_ssize_t nl = PySet_GET_SIZE(local);
    PyObject *ranked = NULL;
    if (nl == 0) {
        if (PyList_GET_SIZE(tier) == 0) {
            PyErr_SetString(PyExc_IndexError, "build: no host in the tier");
            Py_DECREF(local);
            return NULL;
        }
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(tier) && agg == NULL; k++) {
            int b = PySet_Contains(busy, PyList_GET_ITEM(tier, k));
            if (b < 0) {
                Py_DECREF(local);
                return NULL;
            }
            if (!b) agg = PyList_GET_ITEM(tier, k);
        }
        if (agg == NULL) agg = PyList_GET_ITEM(tier, 0);
    } else {
        /* sorted(local, key=rank): ranks are unique, so by (rank, host) */
        ranked = PyList_New(0);
        if (ranked == NULL) {
            Py_DECREF(local);
            return NULL;
        }
        Py_ssize_t pos = 0;
        PyObject *h;
        Py_hash_t hash;
        while (_PySet_NextEntry(local, &pos, &h, &hash)) {
            Py_ssize_t r = rank_of(S->rank, h);
            if (r < 0 && PyErr_Occurred()) goto fail_ranked;
            PyObject *ro = PyLong_FromSsize_t(r);
            PyObject *pair = ro == NULL ? NULL : PyTuple_Pack(2, ro, h);
            Py_XDECREF(ro);
            if (pair == NULL || PyList_Append(ranked, pair) < 0) {
                Py_XDECREF(pair);
                goto fail_ranked;
            }
            Py_DECREF(pair);
        }
        if (PyList_Sort(ranked) < 0) goto fail_ranked;
        if (nl == 1) {
            agg = PyTuple_GET_ITEM(PyList_GET_ITEM(ranked, 0), 1);
        } else {
            for (Py_ssize_t k = 0; k < nl && agg == NULL; k++) {
                PyObject *c = PyTuple_GET_ITEM(PyList_GET_ITEM(ranked, k), 1);
                int b = PySet_Contains(busy, c);
                if (b < 0) goto fail_ranked;
                if (!b) agg = c;
            }
            if (agg == NULL) agg = PyTuple_GET_ITEM(PyList_GET_ITEM(ranked, 0), 1);
        }
    }
    Py_INCREF(agg); /* keep it past ranked and local */
    Py_XDECREF(ranked);
    Py_DECREF(local);
    PyObject *aid = NULL, *copy = NULL, *node = NULL;
    if (PySet_Add(busy, agg) < 0) goto fail;
    aid = PyUnicode_FromFormat("agg:%U:%zd", S->prefix, PyDict_GET_SIZE(S->nodes));
    if (aid == NULL) goto fail;
    if ((copy = PyList_GetSlice(members, 0, nm)) == NULL) goto fail;
    PyObject *values[4] = {point, agg, copy, Py_None};
    if ((node = make_instance(S->node_cls, S->node_fields, values, S->node_fields == Py_None ? 3 : 4)) == NULL)
        goto fail;
    if (PyDict_SetItem(S->nodes, aid, node) < 0) goto fail;
    for (Py_ssize_t k = 0; k < nm; k++)
        if (PyDict_SetItem(S->parent, PyList_GET_ITEM(members, k), aid) < 0) goto fail;
    if (PyDict_SetItem(S->host_of, aid, agg) < 0) goto fail;
    Py_DECREF(agg);
    Py_DECREF(copy);
    Py_DECREF(node);
    return aid;
fail:
    Py_DECREF(agg);
    Py_XDECREF(aid);
    Py_XDECREF(copy);
    Py_XDECREF(node);
    return NULL;
fail_ranked:
    Py_XDECREF(ranked);
    Py_DECREF(local);
    return NULL;
}

static PyObject *list_extend(PyObject *dst, PyObject *src) {
    Py_ssize_t n = PyList_GET_SIZE(dst);
    if (PyList_SetSlice(dst, n, n, src) < 0) return NULL;
    return dst;
}

PyObject *py_build(PyObject *self, PyObject *args) {
    PyObject *groups, *tdepth, *index, *below, *points, *bypass;
    Py_ssize_t fan_in;
    Sum S;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!UO!nOO", &PyDict_Type, &groups, &PyDict_Type, &tdepth, &PyDict_Type,
                          &index, &PyDict_Type, &below, &PyDict_Type, &S.top, &PyDict_Type, &S.rank, &PyDict_Type,
                          &S.host_of, &PyFrozenSet_Type, &points, &S.prefix, &PyDict_Type, &bypass, &fan_in,
                          &S.node_cls, &S.node_fields))
        return NULL;
    PyObject *carried = PyDict_New(), *up = PyDict_New(), *depth = PyDict_New(), *firsts = PyDict_New();
    PyObject *out = NULL, *keys = NULL;
    S.nodes = PyDict_New();
    S.parent = PyDict_New();
    S.summing = PyDict_New();
    S.host_of = PyDict_Copy(S.host_of);
    if (!carried || !up || !depth || !firsts || !S.nodes || !S.parent || !S.summing || !S.host_of) goto done;
    {
        Py_ssize_t it = 0;
        PyObject *on, *uids;
        while (PyDict_Next(groups, &it, &on, &uids)) {
            if (!PyTuple_Check(on)) {
                PyErr_SetString(PyExc_TypeError, "build: group keys must be tuples");
                goto done;
            }
            PyObject *prev = NULL, *first = NULL; /* borrowed */
            for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(on); k++) {
                PyObject *x = PyTuple_GET_ITEM(on, k);
                int in = PySet_Contains(points, x);
                if (in < 0) goto done;
                if (!in) continue;
                int has = PyDict_Contains(carried, x);
                if (has < 0) goto done;
                if (!has) {
                    PyObject *l = PyList_New(0);
                    if (l == NULL || PyDict_SetItem(carried, x, l) < 0) {
                        Py_XDECREF(l);
                        goto done;
                    }
                    Py_DECREF(l);
                    PyObject *d = PyDict_GetItemWithError(tdepth, x);
                    if (d == NULL) {
                        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, x);
                        goto done;
                    }
                    if (PyDict_SetItem(depth, x, d) < 0) goto done;
                }
                if (prev != NULL && PyDict_SetItem(up, prev, x) < 0) goto done;
                if (first == NULL) first = x;
                prev = x;
            }
            if (first == NULL) continue;
            if (PyDict_SetDefault(up, prev, Py_None) == NULL) goto done;
            PyObject *lists = PyDict_GetItemWithError(firsts, first);
            if (lists == NULL) {
                if (PyErr_Occurred() || (lists = PyList_New(0)) == NULL) goto done;
                int rc = PyDict_SetItem(firsts, first, lists);
                Py_DECREF(lists);
                if (rc < 0) goto done;
            }
            if (PyList_Append(lists, uids) < 0) goto done;
        }
    }
    {
        Py_ssize_t it = 0;
        PyObject *x, *lists;
        while (PyDict_Next(firsts, &it, &x, &lists)) {
            PyObject *l;
            if (PyList_GET_SIZE(lists) == 1) {
                l = PySequence_List(PyList_GET_ITEM(lists, 0));
            } else { /* sorted(chain(*lists), key=index): indices are unique, so by (index, id) */
                PyObject *pairs = PyList_New(0);
                if (pairs == NULL) goto done;
                for (Py_ssize_t a = 0; a < PyList_GET_SIZE(lists); a++) {
                    PyObject *f = PySequence_Fast(PyList_GET_ITEM(lists, a), "build: updates must be a sequence");
                    if (f == NULL) {
                        Py_DECREF(pairs);
                        goto done;
                    }
                    for (Py_ssize_t b = 0; b < PySequence_Fast_GET_SIZE(f); b++) {
                        PyObject *uid = PySequence_Fast_GET_ITEM(f, b);
                        PyObject *ix = PyDict_GetItemWithError(index, uid);
                        PyObject *pair = ix == NULL ? NULL : PyTuple_Pack(2, ix, uid);
                        if (ix == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, uid);
                        if (pair == NULL || PyList_Append(pairs, pair) < 0) {
                            Py_XDECREF(pair);
                            Py_DECREF(f);
                            Py_DECREF(pairs);
                            goto done;
                        }
                        Py_DECREF(pair);
                    }
                    Py_DECREF(f);
                }
                if (PyList_Sort(pairs) < 0) {
                    Py_DECREF(pairs);
                    goto done;
                }
                l = PyList_New(PyList_GET_SIZE(pairs));
                for (Py_ssize_t a = 0; l != NULL && a < PyList_GET_SIZE(pairs); a++) {
                    PyObject *uid = PyTuple_GET_ITEM(PyList_GET_ITEM(pairs, a), 1);
                    Py_INCREF(uid);
                    PyList_SET_ITEM(l, a, uid);
                }
                Py_DECREF(pairs);
            }
            if (l == NULL || PyDict_SetItem(carried, x, l) < 0) {
                Py_XDECREF(l);
                goto done;
            }
            Py_DECREF(l);
        }
    }
    /* for x in sorted(carried, key=lambda x: (-depth[x], x)) */
    keys = PyList_New(0);
    if (keys == NULL) goto done;
    {
        Py_ssize_t it = 0;
        PyObject *x, *l;
        while (PyDict_Next(carried, &it, &x, &l)) {
            PyObject *d = PyDict_GetItem(depth, x);
            PyObject *neg = d == NULL ? NULL : PyNumber_Negative(d);
            PyObject *pair = neg == NULL ? NULL : PyTuple_Pack(2, neg, x);
            Py_XDECREF(neg);
            if (pair == NULL || PyList_Append(keys, pair) < 0) {
                Py_XDECREF(pair);
                goto done;
            }
            Py_DECREF(pair);
        }
    }
    if (PyList_Sort(keys) < 0) goto done;
    for (Py_ssize_t q = 0; q < PyList_GET_SIZE(keys); q++) {
        PyObject *x = PyTuple_GET_ITEM(PyList_GET_ITEM(keys, q), 1);
        PyObject *payloads = PyDict_GetItem(carried, x);
        PyObject *nxt = PyDict_GetItem(up, x);
        PyObject *nxt_list = NULL;
        if (nxt != NULL && nxt != Py_None) nxt_list = PyDict_GetItem(carried, nxt);
        Py_ssize_t np = PyList_GET_SIZE(payloads), skip = 0;
        PyObject *b = PyDict_GetItemWithError(bypass, x);
        if (b == NULL && PyErr_Occurred()) goto done;
        if (b != NULL) {
            skip = PyLong_AsSsize_t(b);
            if (skip == -1 && PyErr_Occurred()) goto done;
        }
        if (skip > np) skip = np;
        PyObject *cands = PyDict_GetItemWithError(below, x);
        if (cands == NULL && PyErr_Occurred()) goto done;
        Py_ssize_t nc = cands == NULL ? 0 : PyObject_Length(cands);
        if (nc < 0) goto done;
        if (np - skip < 2 || nc == 0) {
            if (nxt_list != NULL && list_extend(nxt_list, payloads) == NULL) goto done;
            continue;
        }
        PyObject *summed = PyList_GetSlice(payloads, skip, np);
        if (summed == NULL) goto done;
        if (nxt_list != NULL) {
            PyObject *head = PyList_GetSlice(payloads, 0, skip);
            if (head == NULL || list_extend(nxt_list, head) == NULL) {
                Py_XDECREF(head);
                Py_DECREF(summed);
                goto done;
            }
            Py_DECREF(head);
        }
        while (fan_in && PyList_GET_SIZE(summed) > fan_in) { /* too many for one NIC: sum in groups first */
            PyObject *next = PyList_New(0);
            if (next == NULL) {
                Py_DECREF(summed);
                goto done;
            }
            Py_ssize_t ns = PyList_GET_SIZE(summed);
            for (Py_ssize_t a = 0; a < ns; a += fan_in) {
                Py_ssize_t e = a + fan_in < ns ? a + fan_in : ns;
                PyObject *group = PyList_GetSlice(summed, a, e);
                PyObject *aid = NULL;
                int ok = group != NULL;
                if (ok && e - a < 2) {
                    ok = list_extend(next, group) != NULL;
                } else if (ok) {
                    aid = sum_at(&S, x, group);
                    ok = aid != NULL && PyList_Append(next, aid) == 0;
                }
                Py_XDECREF(group);
                Py_XDECREF(aid);
                if (!ok) {
                    Py_DECREF(next);
                    Py_DECREF(summed);
                    goto done;
                }
            }
            Py_SETREF(summed, next);
        }
        PyObject *aid = sum_at(&S, x, summed);
        Py_DECREF(summed);
        if (aid == NULL) goto done;
        int rc = nxt_list != NULL ? PyList_Append(nxt_list, aid) : 0;
        Py_DECREF(aid);
        if (rc < 0) goto done;
    }
    {
        Py_ssize_t it = 0;
        PyObject *aid, *node;
        while (PyDict_Next(S.nodes, &it, &aid, &node)) { /* node.parent = parent.get(aid) */
            PyObject *p = PyDict_GetItem(S.parent, aid);
            if (PyObject_SetAttr(node, str_parent, p == NULL ? Py_None : p) < 0) goto done;
        }
    }
    out = PyTuple_Pack(2, S.nodes, S.parent);
done:
    Py_XDECREF(carried);
    Py_XDECREF(up);
    Py_XDECREF(depth);
    Py_XDECREF(firsts);
    Py_XDECREF(keys);
    Py_XDECREF(S.nodes);
    Py_XDECREF(S.parent);
    Py_XDECREF(S.summing);
    Py_XDECREF(S.host_of);
    return out;
}
