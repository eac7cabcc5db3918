%% The tags of convoy's internal messages and entries, each written once here.
%% Internal: only convoy's own processes send and match them. Tests in test/
%% spell the atoms out on purpose, so a change here that alters the format
%% between nodes fails there.
%%
%% None may be confused with user data (any term is a message, any atom a name):
%% how each is told apart is the table "Tags and user data" in doc/design.md.
%% Match a tag with its whole shape, never by its first element alone.

%% Between nodes (convoy_wire owns the format): the envelope of every message,
%% `{?TAG_WIRE, Version, Kind, ...}', and the entries of a batch that are not
%% plain messages.
-define(TAG_WIRE, '$convoy').
-define(TAG_BARRIER, '$convoy_barrier').
-define(TAG_METER, '$convoy_meter').
-define(TAG_PIECE, '$convoy_piece').
%% A publish: `{?TAG_PUBLISH, Scope, Group, Msg}' on the wire, and
%% `{?TAG_PUBLISH, Scope, Group}' as the destination of a multicast entry on
%% this node (convoy_publish, convoy_route, convoy_lane, convoy_lane_core).
-define(TAG_PUBLISH, '$convoy_publish').

%% A sender to its lane (convoy_route to convoy_lane): a message to queue, by
%% kind `{Kind, Node, To, Msg, Bytes}'; several small ones in one hand-over
%% (`{?TAG_SENDS, Sends, N}', `convoy:send_many/1'); a blocked sender's wait for
%% room; a probe of a node that did not answer; a flush (`convoy_wait:flush/2').
-define(TAG_SEND, '$convoy_send').
-define(TAG_SENDS, '$convoy_sends').
-define(TAG_LARGE, '$convoy_large').
-define(TAG_MULTICAST, '$convoy_multicast').
-define(TAG_WAIT, '$convoy_wait').
-define(TAG_PROBE, '$convoy_probe').
-define(TAG_FLUSH, '$convoy_flush').
%% A sender waiting for a barrier's answer with an admission that the lane
%% disposes of (`{?TAG_OWED, Sender}' before the wait, `{?TAG_OWED_DONE, Sender}'
%% after it; or the sender's `DOWN' if it dies meanwhile).
-define(TAG_OWED, '$convoy_owed').
-define(TAG_OWED_DONE, '$convoy_owed_done').
%% In a lane's queues (convoy_lane_core, convoy_batch): `{?TAG_LARGE, To, Msg}'
%% (a large message) and `{?TAG_MARK, Id, Node}' (a flush waiting for what is
%% before it to leave), the only 3-tuples among entries `{To, Msg}': a message to
%% a process registered as '$convoy_mark' is `{'$convoy_mark', Msg}'.
-define(TAG_MARK, '$convoy_mark').

%% Between convoy_control and the lanes, each with the control's secret: a lane
%% change or a stop (see convoy_control).
-define(TAG_HOLD, '$convoy_hold').
-define(TAG_RELEASE, '$convoy_release').
-define(TAG_RETIRE, '$convoy_retire').
-define(TAG_RETIRING, '$convoy_retiring').
-define(TAG_NODE_DONE, '$convoy_node_done').
-define(TAG_RETIRED, '$convoy_retired').
%% From convoy_peers to convoy_control: a node's row
%% was forgotten; checked there (no row, not connected) before its lanes retire.
-define(TAG_FORGOTTEN, '$convoy_forgotten').

%% convoy:call/2,3 (convoy_gen) and the monitors it shares (convoy_calls): a
%% watch taken, a server's `DOWN' passed on, and the tag of the `DOWN' a caller
%% gets when convoy_calls goes mid-call, `{?CALLS_GONE, Alias}'.
-define(TAG_CALL_WATCHING, '$convoy_call_watching').
-define(TAG_CALL_DOWN, '$convoy_call_down').
-define(CALLS_GONE, '$convoy_calls_gone').
%% Within convoy_calls: a watcher's report that it holds its server's monitor,
%% and the tag of the exit reason that carries the server's `DOWN' reason.
-define(TAG_CALLS_WATCHING, '$convoy_calls_watching').
-define(TAG_CALLS_WATCH_DOWN, '$convoy_calls_watch_down').

%% Credit from a channel's consumer to its producer (convoy_channel).
-define(TAG_CREDIT, '$convoy_credit').

%% Sends and monitors that never suspend their owner (convoy_remote): the tag of
%% a courier's `DOWN', `{?TAG_COURIER, Node}', and that of the `DOWN' of an
%% inbox's watch of a piece's keeper, `{?TAG_KEEPER_DOWN, Keeper}'.
-define(TAG_COURIER, '$convoy_courier').
-define(TAG_KEEPER_DOWN, '$convoy_keeper_down').
