// Package bootid reads the kernel's boot id: a random UUID the kernel
// draws at each boot (/proc/sys/kernel/random/boot_id). A record stamped
// with another boot's id was written before the host last went down:
// whatever the page cache held then, and every mount, is gone.
package bootid
