/* Shared by plan_stf.c and plan_stf_links.c: the STF planner's run in C (stf_planner.Planner.run). */
#ifndef MLF_PLAN_STF_H
#define MLF_PLAN_STF_H
#include "_plan_native.h"

/* an entry of a gate link's group: (d, nbytes, uid, class), as the Python group heaps hold it */
typedef struct {
    double d, nbytes;
    Py_ssize_t uid, cls;
} GEntry;

/* an entry of the main heap: (key, nbytes, uid, seq, kind, ref) */
typedef struct {
    double key, nbytes;
    Py_ssize_t uid, seq;
    int kind;
    Py_ssize_t ref;
} MEntry;

enum { K_EXACT = 0, K_GROUP = 1 };

/* one link: its timeline's lists (a real LinkTimeline's) or, for a link the Timelines has
   made no timeline for yet, its graph capacity from the origin on (one piece) */
typedef struct {
    PyObject *key;              /* the link tuple (new reference) */
    PyObject *times, *residual; /* borrowed from the LinkTimeline (own: held here); NULL: not made yet */
    char own;
    double cap, eps;            /* where times is NULL */
    char has_cap;               /* cap is the graph's (no profile): stf_realize makes the timeline here */
    long modified;              /* stamp of its last reservation, -1: none */
    double free, peak;          /* Planner.free_from / peak, cached */
    char free_ok, peak_ok, popped_known, popped;
    GEntry *g; /* its group (a heap) */
    Py_ssize_t gn, gcap;
    Py_ssize_t live; /* sequence number of the group's live heap entry, -1: none */
    char has_key;    /* group_key: the live entry's (key, nbytes, uid) */
    double k_key, k_nbytes;
    Py_ssize_t k_uid;
} Lnk;

/* one update (planner id) */
typedef struct {
    PyObject *uid; /* new reference */
    double nbytes;
    Py_ssize_t cls; /* the class it is in now */
    char gone;
    Py_ssize_t nl, l0; /* its links, in the pool from l0; nl -1: not looked up yet */
    PyObject *links;   /* its links tuple (new reference) */
    PyObject *row;     /* the book's (links, numbers, src, dst, bytes, server) (new reference) or NULL */
} Upd;

/* one class of updates sharing a ten() function: members sorted by (nbytes, uid) */
typedef struct {
    PyObject *start_o; /* new reference */
    double start;
    Py_ssize_t *m;
    Py_ssize_t n, cap, head;
    /* its members as the planner listed them (borrowed; NULL: all in m), the first pq of the pn
       taken into m so far: the rest are taken as the head reaches them (stf_take) */
    PyObject *pm;
    Py_ssize_t pq, pn;
    char checked;    /* pm's members checked by set_up (else each as it is taken) */
    Py_ssize_t gate; /* the link whose group holds its head, -1: none */
    char ex_ok;      /* the head's latest computed ten: uid, stamp, end, rate pieces */
    Py_ssize_t ex_uid;
    long ex_stamp;
    double ex_end;
    double *ex_p; /* (lo, hi, rate) triples */
    Py_ssize_t ex_n, ex_cap;
} Cls;

/* one server key: its version, tau_max and payloads ahead (Python ints), planned so far */
typedef struct {
    PyObject *version, *bound, *ahead; /* new references; bound NULL: no tau_max */
    long accepted;
} Srv;

typedef struct {
    /* inputs, borrowed */
    PyObject *class_of, *class_of_key, *on_first_link, *book_on_link, *popped, *by_id, *links_of, *names;
    PyObject *now_o, *tau_max, *server_version, *ahead;
    PyObject *tls, *tls_links, *succ, *profiles;
    PyObject *transfer_cls, *fields, *reservation_cls, *timeline_cls, *drop_reason, *drops;
    /* the book's link numbers (NULL: links are numbered here, as first seen): update -> (its
       links, their numbers, and its update's src, dst, bytes and server: read there, not as
       attributes), number -> link, number -> its graph capacity (None: not read yet; filled
       here) */
    PyObject *ix_of, *link_list, *cap_cache;
    /* book number -> its slot in st->l + 1 (0: none yet); the slots are made as the links are
       first used, side by side (not one per number: the book numbers every NIC it has seen,
       ~11,000 at 10,240 workers, and a decision uses a few thousand, issue 24) */
    int32_t *slot_of;
    Py_ssize_t nbook;
    /* the planner's class_index (NULL: every member of every class indexed before the loop) */
    PyObject *class_index;
    /* the links whose timelines new_timeline made and stf_flush has not put in the Timelines yet;
       keep: flushed at the end (else the Timelines is left without them: its caller drops it) */
    Py_ssize_t *made;
    Py_ssize_t nmade, madecap;
    char keep;
    double now, t0, eps;
    /* made here */
    PyObject *transfers, *uid_ix, *link_ix, *srv_ix;
    PyObject *t0_o; /* the Timelines' origin (its _start), fetched when first needed */
    Upd *u;
    Py_ssize_t nu, ucap;
    Py_ssize_t *pool;
    Py_ssize_t npool, poolcap;
    Lnk *l;
    Py_ssize_t nl, lcap;
    Cls *c;
    Py_ssize_t nc, ccap;
    MEntry *heap;
    Py_ssize_t nh, hcap;
    Srv *s;
    Py_ssize_t ns, scap;
    Py_ssize_t seq;
    long stamp;
    double *scratch; /* pieces of the last walk */
    Py_ssize_t nscratch, scratchcap;
} STF;

extern PyObject *s_capacity; /* "capacity", made by stf_run */

/* grow *p (of *cap elements of `size` bytes) to hold `need`; 0 or -1 (MemoryError set) */
int stf_grow(void **p, Py_ssize_t *cap, Py_ssize_t need, size_t size);

/* plan_stf.c */
extern PyObject *s_ready_at, *s_base_version, *s_dst, *s_bytes, *s_path_tag, *s_get, *s_rates, *s_reserve, *s_who;
Py_ssize_t stf_new_class(STF *st, PyObject *start_o);   /* index, -1 on error */
int stf_class_append(Cls *c, Py_ssize_t ui);
Py_ssize_t stf_uid_index(STF *st, PyObject *uid, double nbytes, int *fresh);
Py_ssize_t stf_add_exact(STF *st, Py_ssize_t ui);        /* Planner.add(uid, exact=True) */
int stf_place(STF *st, Py_ssize_t ci);                   /* Planner.place */
int stf_loop(STF *st, Py_ssize_t limit);                 /* Planner.run's loop */
/* plan_stf_run.c: Planner.accept */
int stf_accept(STF *st, Py_ssize_t ci, Py_ssize_t ui, double nbytes);
/* the next listed member of class ci into its m (its index made on first sight); 0 or -1 */
int stf_take(STF *st, Py_ssize_t ci);
/* every listed member of class ci into its m; 0 or -1 */
int stf_take_all(STF *st, Py_ssize_t ci);

/* plan_stf_links.c */
Py_ssize_t stf_link(STF *st, PyObject *link); /* index of `link`, -1 on error */
int stf_realize(STF *st, Py_ssize_t li);        /* make the link's LinkTimeline; 0 or -1 */
int stf_flush(STF *st); /* the timelines made and not yet in the Timelines put there, in order; 0 or -1 */
Py_ssize_t *stf_links_of(STF *st, Py_ssize_t ui, Py_ssize_t *n); /* NULL on error */
double stf_free_from(STF *st, Py_ssize_t li);
double stf_peak(STF *st, Py_ssize_t li);
double stf_min_over(STF *st, Py_ssize_t li, double lo, double hi);
/* Timelines._walk(record=True) without reserving: 1 (end, pieces in st->scratch), 0: never has
   residual bandwidth, -1: error */
int stf_walk(STF *st, Py_ssize_t ui, double nbytes, double ready, double *end);

#endif
