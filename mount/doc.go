// Package mount is a small Linux layer over mount(2), umount2(2), the mount
// table and the filesystem ioctls that csiagent needs: mounting a block device,
// bind mounts (optionally read-only), safe bind mounts into a container's
// root filesystem, also inside the container's own mount namespace,
// idempotent unmounts, mount-table lookups, removal of empty mount
// directories, FITRIM and FIFREEZE/FITHAW.
//
// The package holds no state: every function acts on the kernel directly and
// is safe for concurrent use. Callers serialize operations on the same path
// themselves (csiagent locks per volume).
//
// # Contract
//
//   - [Mount] and [Bind] fail if the kernel refuses; they never check the mount
//     table first. A caller that must not stack mounts looks the target up with
//     [Lookup] before calling them.
//   - [Unmount] is idempotent: a missing path or a path that is not a mount
//     point counts as done (ENOENT, EINVAL). EBUSY is retried a bounded
//     number of times, then reported with [ErrBusy]. It never detaches lazily.
//   - [IsMountPoint] reads no mount table: it is one statx of the path
//     (symlinks followed, no automount triggered) whose
//     STATX_ATTR_MOUNT_ROOT says whether the path is the root of a mount;
//     a path that does not exist is not a mount point. Only on a kernel
//     that does not report that attribute (before 5.8) does it fall back
//     to [Lookup]. [Lookup] asks the same statx first and reads the table
//     only when the path is (or may be) a mount point.
//   - [Lookup] and [List] read the calling thread's mountinfo through a
//     filter, in one pass, via pathrs-lite's private procfs handle (never
//     the /proc a container's namespace shows). Paths are resolved
//     (symlinks, "..") first, because the mount table only holds canonical
//     paths.
//   - [ResolveInRoot] then [BindInto] put a volume at a path chosen by an
//     untrusted party (a container_path inside a container's rootfs).
//     ResolveInRoot resolves it as if the rootfs were "/" (openat2
//     RESOLVE_IN_ROOT via pathrs-lite: no symlink or ".." leaves the root),
//     creates missing directories through their parents' handles (0755,
//     optionally chowned) and, for a block volume ([File]), an empty file
//     with O_CREAT|O_EXCL|O_NOFOLLOW. It returns an O_PATH handle and the
//     target's real host path. BindInto mounts onto that handle with the new
//     mount API (open_tree clone, mount_setattr nosuid, nodev (not for a
//     device node: a block volume) and read-only when asked while detached,
//     move_mount onto the descriptor): nothing is looked up by name between
//     resolution and mount, so swapping the path for a symlink meanwhile does
//     not move the mount, and a read-only bind is never writable. The bind is
//     recursive: submounts of the source come along (with the same flags).
//     Record the returned host path and the mount's identity ([ID] of
//     the target handle before the move: the mount it goes on; [ID] and
//     [RootOf] of the [CloneTree] descriptor: the new mount and its
//     root): they are what to unmount later, with [UnmountOwn].
//     BindInto is [CloneTree] (open_tree clone, nosuid, nodev and
//     read-only at once) then [MoveTree] (kind check, move_mount onto the
//     handle).
//   - [InNamespace] runs a function on a throwaway OS thread that has
//     entered the mount namespace of a process (unshare(CLONE_FS), then
//     setns on /proc/<pid>/ns/mnt, whose inode is checked against the one
//     [MountNamespace] recorded, so a reused pid is refused with
//     [ErrWrongNamespace]); a gone process is [ErrNoProcess]. The thread is
//     never unlocked, so Go ends it with the goroutine, and it is never the
//     main thread; the caller's goroutine and thread are untouched. This is
//     how a volume reaches a container whose "/" is private: [CloneTree] on
//     the host (the source is a host path), then, inside InNamespace,
//     [ResolveInRoot] and [MoveTree] (the target must be in the thread's
//     namespace; a handle resolved on the host is refused, EINVAL). Inside,
//     [UnmountOwn], [List] and [RemoveEmptyTree] act on the container's
//     mounts. Paths inside are the namespace's: before pivot_root (an OCI
//     createRuntime hook) the rootfs is at its host path, after it (a
//     running container) the root is the container's and so are the paths.
//   - [UnmountOwn] removes exactly one recorded mount ([Identity]: mount
//     id, the mount it was put on, its source, its root) inside a root the
//     caller trusts, below which nothing is trusted: the mount point's
//     parent is opened with openat2 RESOLVE_IN_ROOT|RESOLVE_NO_SYMLINKS,
//     statx of the name through it must show the recorded id (and the
//     recorded root's inode: ids are reused; never the source looked up
//     in a namespace a container controls; a mount with our id whose
//     root cannot be checked is [ErrUnverified]), and umount2 through that handle
//     (UMOUNT_NOFOLLOW) takes off just the top mount, so one underneath
//     (a runtime's tmpfs) stays. Mounts inside ours go first, by id; a
//     mount on top of ours is refused ([ErrCovered]); a mount that moved
//     is found by id in mountinfo and unmounted only below the root
//     ([Moved]); one that is not there is reported [Gone], and so is any
//     below a root that no longer exists, unless its id is still in
//     mountinfo (the root moved with it: not touched). The same inside
//     [InNamespace] (never through the namespace's /proc).
//   - [MountsUnder] lists mount points at or below a directory (one pass,
//     prefix filter). [RemoveEmptyTree] removes a directory tree of empty
//     directories and empty files, bottom up, one entry at a time through
//     directory handles; it refuses ([ErrMounted]) if anything is mounted at
//     or below it and never descends into a mount point (RESOLVE_NO_XDEV),
//     and refuses ([ErrNotEmpty]) anything holding data. It never calls
//     os.RemoveAll.
//   - [Trim], [Freeze] and [Thaw] act on the whole filesystem that holds the
//     path: FITRIM on a bind mount of a subdirectory trims the entire
//     filesystem.
//
// # When not to call it
//
// Do not query the mount table before a mount or an unmount just to decide
// whether to call it: mount, then handle the error; unmount, and let
// [Unmount] treat "not mounted" as done. Do not check the table after a
// successful mount or unmount either: the syscall's result is the answer.
// Do not call [Lookup] in a loop over many paths: call [List] once with a
// filter. Never call [Freeze] without arranging the [Thaw] on a separate
// goroutine with a deadline: a writer blocked on a frozen filesystem cannot be
// killed, so [WhileFrozen] is the safe form.
//
// Do not use [Bind] or [Mount] on a path inside a container's rootfs: they
// follow symlinks by name and can be redirected out of the rootfs. Use
// [ResolveInRoot] and [BindInto]. Likewise never unmount a path inside a
// rootfs by its name ([Unmount]): the container can swap any component for a
// link or put its own mount there; use [UnmountOwn]. Conversely, paths the
// agent owns (its work directory, the CSI staging and target paths) need no
// in-root resolution: use them as they are. Do not call [MountsUnder] to
// decide whether to unmount ([Unmount] and [UnmountOwn] are idempotent),
// only to decide whether a directory may be deleted, and do not delete mount
// directories any other way than [RemoveEmptyTree]: a directory holding data
// (a volume.state file, say) is refused, by design. [MountsUnder] sees the
// calling thread's mount namespace only: mounts made inside a container's
// own namespace are not in it, unless it is called inside [InNamespace].
//
// Do not mount into a container from the host when the container has its own
// mount namespace: the host's mounts under a private "/" never reach it. Do
// not resolve a target on the host and move a tree onto it inside
// [InNamespace] (refused), nor resolve it inside and use it on the host.
// Close a [CloneTree] descriptor as soon as [MoveTree] has succeeded: while
// it is open the mount stays busy (umount gets EBUSY), and a second
// MoveTree of it would move the attached mount again. Inside [InNamespace]
// do not start goroutines for namespace work: only f's own goroutine is in
// the namespace.
//
// ResolveInRoot needs openat2 (Linux 5.6), ID and UnmountOwn statx mount
// ids (5.8), BindInto, CloneTree and MoveTree
// mount_setattr (5.12), InNamespace a procfs with subset=pid (5.8) for its
// procfs lookups to stay independent of the container's /proc.
//
// Everything here needs CAP_SYS_ADMIN except the read-only lookups.
package mount
