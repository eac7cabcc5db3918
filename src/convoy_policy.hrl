%% The adaptive policy's constants, in one place: every rule that uses them
%% chooses among paths that are all safe (see convoy_path's header). Each is in
%% doc/design.md's table of them with what it does and why
%% (`convoy_path:constants/0', checked by a test); the measurements behind the
%% values are in doc/decisions.md.

%% No small message on the lane for this long: a marked sender's barrier (one
%% round trip, tens of microseconds on a LAN) costs little beside the idle gap.
-define(SETTLED_US, 1000).
%% A busy lane is worth its two extra hops (the lane's and the peer inbox's) only if
%% it ships batches of at least this many messages on average (in sixteenths: one
%% and an eighth). Among enough senders (`BATCH_SENDERS') that is low enough not
%% to leave batching at every window of small batches, which is self-fulfilling:
%% each sender that leaves makes the lane's batches smaller. Batches of about one
%% message (senders that meet on the lane only by chance) still send them direct.
%% Evidence: doc/decisions.md.
-define(PAYS_X16, 18).
%% A lane whose batches did not pay is tried again after this long (so a flood
%% that starts while senders go direct is batched again within this time).
-define(PROBE_US, 10000).
%% A busy lane is taken by senders that do not stream only while about this many
%% senders or more take turns on it (the ratio of the recent gaps between a small
%% send and its sender's previous one to those between small sends on the lane).
%% Fewer fill batches too small to pay for the extra hops, and the rate of small
%% sends cannot tell them apart (doc/decisions.md).
-define(BATCH_SENDERS, 8).
%% Gaps are averaged in GAP_UNITths of a microsecond, each new one weighing
%% 1/GAP_WEIGHT: the lane's gaps between small sends counted at most GAP_CAP_US
%% (one long pause is forgotten after about a hundred sends), and each sender's gap
%% since its own previous small send at most OWN_GAP_CAP_US (a sender's first send
%% counts so). Their ratio estimates how many senders take turns, and it must hold
%% through the pause after each burst of a closed loop under batching (a lighter
%% weight let pairs leave the lane; doc/decisions.md).
-define(GAP_UNIT, 256).
-define(GAP_WEIGHT, 32).
-define(GAP_CAP_US, 1000). % 256,000 GAP_UNITs: within convoy_slots' LANE_GAP_BITS
-define(OWN_GAP_CAP_US, 10000).
%% While batches pay, the lane judges them over windows of this long (us).
-define(WINDOW_US, 2000).
%% An unmarked sender that found its lane calm reuses that calm this many sends.
-define(CALM_REUSE, 3).
%% A marked sender skips recording at most this many small sends in a row.
-define(SKIP_MAX, 15).
