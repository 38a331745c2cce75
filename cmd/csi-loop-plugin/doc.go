// Command csi-loop-plugin is a CSI plugin whose volumes are sparse image
// files in a pool directory, attached to loop devices. See package
// loopplugin.
//
//	csi-loop-plugin [--endpoint unix:///path] --pool DIR [--replica-pool DIR] [--node-id ID] [--name NAME]
//	csi-loop-plugin create-volume --pool DIR --name NAME --size 1GiB
//	csi-loop-plugin delete-volume --pool DIR --name NAME
//	csi-loop-plugin --version
//
// The endpoint defaults to $CSI_ENDPOINT, the node id to $MESOS_AGENT_ID,
// else the host name. --replica-pool enables csi-addons replication to a
// second pool directory; a plugin serving that pool with --replica-pool
// pointing back serves the other side of each replicated volume. Logs go
// to stderr. SIGINT and SIGTERM stop the server gracefully; staged and
// published volumes stay as they are, and a plugin started later (even
// after SIGKILL) carries on with them.
//
// create-volume and delete-volume work on the pool directly, for an
// operator pre-provisioning volumes; they take no lock, so do not run them
// on a volume the serving plugin is working on.
package main
