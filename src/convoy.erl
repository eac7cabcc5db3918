%% @doc Batched, ordered message passing between Erlang nodes.
%%
%% `convoy:send/2' means what `erlang:send/2' means (asynchronous, at most once,
%% order kept per sender and receiver), but messages to another node travel in
%% batches: one distribution message carries everything waiting for that node, and
%% a batch leaves as soon as convoy's outbound lane has nothing more to read, so an
%% idle message is not delayed. See the README for the guarantees and the
%% settings, doc/design.md for the design.
%%
%% convoy runs as an OTP application (`application:ensure_all_started(convoy)',
%% settings from its environment) or inside your own supervision tree
%% (`convoy:child_spec/1'). When it is not running, `send/2', `multicast/2' and
%% `publish/2,3' fall back to plain sends, and `cast/2' and `call/2,3' to
%% gen_server's.
-module(convoy).

-export([send/2, send/3, send_many/1, multicast/2, publish/2, publish/3, flush/0, flush/1, flush/2, info/0, set_config/1,
         settings/0, child_spec/1, start_link/1]).
-export([multicast/3, cast/2, call/2, call/3, batch/1]).

-export_type([dest/0, options/0, send_options/0, options_in/0, send_options_in/0, info/0,
              node_info/0, forgotten/0]).
-export_type([server_ref/0]).

-type dest() :: pid() | atom() | {atom(), node()} | reference().
%% A process (pid), a locally registered name, a name registered on a node, or an
%% alias.
-type server_ref() :: gen_server:server_ref().
%% A gen_server as `gen_server:call/2' and `gen_server:cast/2' take it: a pid, a
%% local name, `{Name, Node}', `{global, Name}' or `{via, Module, Name}'.
-type options() :: #{lanes => pos_integer(),
                      max_batch => pos_integer(),
                      max_delay => non_neg_integer(),
                      large_threshold => non_neg_integer() | infinity,
                      chunk_threshold => non_neg_integer() | infinity,
                      chunk_bytes => pos_integer(),
                      chunk_window => pos_integer(),
                      chunk_guard => non_neg_integer() | always,
                      max_reassembly_bytes => pos_integer() | infinity,
                      barrier_timeout => non_neg_integer(),
                      bypass_after => non_neg_integer() | never,
                      max_buffered => pos_integer() | infinity,
                      max_buffered_bytes => pos_integer() | infinity,
                      overload => block | drop | error,
                      block_timeout => non_neg_integer(),
                      telemetry => boolean(),
                      compress => never | auto | 1..9}.
%% Settings, each one optional: those not given keep their defaults (for
%% `set_config/1', the values in force); `settings/0' lists the accepted values,
%% the README's Settings table says what each one means. Wherever they are taken,
%% a list of `{Key, Value}' (a proplist, an Elixir keyword list) is taken as the
%% map of its pairs.
-type send_options() :: #{overload => block | drop | error,
                          block_timeout => non_neg_integer()}.
%% Per-call overload behaviour; see `send/3'. A list of `{Key, Value}' is taken too.
-type options_in() :: options() | [{atom(), term()}].
-type send_options_in() :: send_options() | [{atom(), term()}].
-type node_info() :: #{route := convoy | plain,
                       accepted := non_neg_integer(),
                       messages := non_neg_integer(),
                       batches := non_neg_integer(),
                       dropped := non_neg_integer(),
                       buffered := non_neg_integer(),
                       received := non_neg_integer(),
                       direct := non_neg_integer(),
                       chunked := non_neg_integer(),
                       stalled := non_neg_integer(),
                       waited_us := non_neg_integer(),
                       unanswered := boolean(),
                       refused := non_neg_integer(),
                       blocked_us := non_neg_integer(),
                       queued := non_neg_integer(),
                       queued_bytes := non_neg_integer(),
                       compressed_batches := non_neg_integer(),
                       compressed_bytes_in := non_neg_integer(),
                       compressed_bytes_out := non_neg_integer()}.
%% One remote node's route and counters, as `info/0' describes them.
-type info() :: #{running := boolean(),
                  settings := options(),
                  nodes := #{node() => node_info()},
                  lanes := [#{index := pos_integer(), pid := pid(),
                              queue := non_neg_integer()}],
                  forgotten := forgotten(),
                  rejected := #{atom() => non_neg_integer()},
                  lost := non_neg_integer(),
                  channels := #{waits := non_neg_integer(),
                                wait_time_us := non_neg_integer()}}.
%% What `info/0' returns.
-type forgotten() :: #{nodes := non_neg_integer(),
                       totals := #{atom() => non_neg_integer()},
                       last := [#{node := node(), at := integer(),
                                  counters := #{atom() => non_neg_integer()}}]}.
%% Nodes whose counters left `nodes' (gone and idle for a while, see the README):
%% how many, the totals of their final counters, and the last few of them (`at' in
%% system time milliseconds).

%% @doc Send `Msg' to `Dest'. Same meaning as `erlang:send/2': asynchronous, at most
%% once, order kept per sender/receiver pair (among messages sent through convoy;
%% `!' and `convoy:send/2' to one process are not ordered with each other). Local
%% destinations get the message at once; remote ones through the sender's lane.
%% The caller waits only when convoy already holds `max_buffered' messages (or
%% `max_buffered_bytes') for that node: then the `overload' setting applies
%% (default `block': wait up to `block_timeout' ms for room), and a message that
%% finds no room is dropped and counted in `dropped', as `!' gives no error either.
%% A large message may also wait up to `barrier_timeout' ms for the sender's
%% earlier messages to be delivered. Never suspends the caller on a busy or
%% unconnected distribution connection. Raises `badarg' where `!' would.
-spec send(dest(), term()) -> ok.
send(Pid, Msg) when is_pid(Pid) ->
    %% Here, not in convoy_route: a local send costs `!' plus this one call, and
    %% a remote pid's node is read once.
    case node(Pid) of
        Node when Node =:= node() ->
            Pid ! Msg,
            ok;
        Node ->
            convoy_route:send_remote(Node, Pid, Msg)
    end;
send(Dest, Msg) ->
    convoy_route:send(Dest, Msg).

%% @doc Send `Msg' to `Dest' with a per-call overload behaviour, for when convoy
%% already holds `max_buffered' messages or `max_buffered_bytes' for that node:
%% `block' waits for room up to `block_timeout' ms, then returns
%% `{error, overload}'; `drop' drops the message (counted in `dropped') and returns
%% `ok'; `error' returns `{error, overload}' at once (counted in `refused').
%% Unset keys take the settings' values; set ones are checked with the settings'
%% bounds. Bad options raise `{badarg, Reason}', `Reason' as
%% `convoy_config:error()' says (`{bad_option, Key}', `{bad_value, Key, Value}',
%% ...); a bad destination raises `badarg' as `erlang:send/2' would.
-spec send(dest(), term(), send_options_in()) -> ok | {error, overload}.
send(Dest, Msg, Opts) ->
    case convoy_config:send_options(Opts) of
        {ok, Checked} ->
            ok = convoy_route:leave(), % its result depends on the room now
            convoy_route:send(Dest, Msg, Checked);
        {error, Reason} -> erlang:error({badarg, Reason}, [Dest, Msg, Opts])
    end.

%% @doc Send each `{Dest, Msg}' of the list, as `send/2' would one by one in
%% list order: the same order per sender and receiver, bounds, overload policy
%% and fallbacks. Cheaper than a loop: the small messages for a node reach the
%% sender's lane in one hand-over, with one admission and room taken for all of
%% them at once, or, when the lane is idle, go to the peer's inbox as one batch
%% (as the lane would ship them); a node whose messages do not all fit, or that
%% is sent a large one, gets them one by one as `send/2' sends them. Everything
%% is checked first: an invalid destination or an unregistered local name (an
%% atom) raises `badarg' with nothing sent; a `{Name, node()}' not registered is
%% skipped, as `!' drops a message to it.
-spec send_many([{dest(), term()}]) -> ok.
send_many(Sends) ->
    ok = convoy_route:leave(),
    convoy_route:send_many(Sends).

%% @doc Send `Msg' to every destination: one copy travels to each remote node and is
%% fanned out there. Order relative to the caller's `send/2' to each destination is
%% kept. Raises `badarg', with nothing sent, if any destination is invalid or a local
%% name (an atom) is not registered; a `{Name, node()}' not registered is skipped,
%% as `!' drops a message to it.
-spec multicast([dest()], term()) -> ok.
multicast(Dests, Msg) ->
    convoy_route:multicast(Dests, Msg).

%% @doc `multicast/2' with this call's behaviour at each node's bound, as
%% `send/3' takes it (`overload', `block_timeout'): `{error, overload}' when a
%% node's copy found no room and the call asked for `block' or `error' (the other
%% nodes' copies are sent); `drop' drops it (counted in `dropped'). Bad options
%% raise `{badarg, Reason}' before anything is sent.
-spec multicast([dest()], term(), send_options_in()) -> ok | {error, overload}.
multicast(Dests, Msg, Opts) ->
    case convoy_config:send_options(Opts) of
        {ok, Checked} ->
            ok = convoy_route:leave(), % its result depends on the room now
            convoy_route:multicast(Dests, Msg, Checked);
        {error, Reason} ->
            erlang:error({badarg, Reason}, [Dests, Msg, Opts])
    end.

%% @doc `gen_server:cast/2' through convoy: the server gets
%% ``{'$gen_cast', Request}'', sent as `send/2' sends it, so it keeps its order with
%% the caller's other convoy traffic to that server. Global and via names are
%% looked up (`whereis_name/1') and the process found gets the cast. Returns `ok'
%% for a server or node that is gone, as gen_server does; a malformed
%% `ServerRef' raises what `gen_server:cast/2' raises.
-spec cast(server_ref(), term()) -> ok.
cast(ServerRef, Request) ->
    convoy_gen:cast(ServerRef, Request).

%% @doc `gen_server:call/2' (5 s timeout) with the request travelling through
%% convoy; see `call/3'.
-spec call(server_ref(), term()) -> term().
call(ServerRef, Request) ->
    ok = convoy_route:leave(), % the server must see what was collected first
    convoy_gen:call(ServerRef, Request).

%% @doc `gen_server:call/3' with the request travelling through convoy, in order
%% with the caller's other convoy traffic to that node; the server sees an
%% ordinary call and answers as usual, and its answer comes back directly. Exits
%% as gen_server does: `{Reason, {gen_server, call, [ServerRef, Request,
%% Timeout]}}' with `Reason' `timeout', `noproc', `{nodedown, Node}' or the
%% server's exit reason. A reply that comes after the timeout is dropped (the
%% call's alias is gone), never left in the mailbox. Timeout counts from the
%% call, including any wait for room in convoy when the node's bound is reached
%% (a call waits for room whatever the `overload' setting). The caller takes no
%% remote monitor itself, so a node stalled with a full distribution buffer
%% holds it no longer than Timeout (gen_server:call's monitor would suspend it
%% until the buffer drains). A server on this node, or any call while convoy is
%% not running, is `gen_server:call/3' itself.
-spec call(server_ref(), term(), timeout()) -> term().
call(ServerRef, Request, Timeout) ->
    ok = convoy_route:leave(),
    convoy_gen:call(ServerRef, Request, Timeout).

%% @doc Run `Fun' and return what it returns, the caller's `send/2', `cast/2' and
%% `multicast/2' to other nodes inside it collected and sent together when it
%% returns: runs of sends as one `send_many/1' (a run of one as `send/2'), each
%% multicast in its place, so a loop that sends (a `handle_info' notifying
%% subscribers, an `Enum.each' over sockets' owners) hands its lane one batch
%% instead of a message at a time.
%% Destinations are checked at each call (a bad one raises there, as `!' would);
%% local destinations get their message at once. What was collected leaves
%% earlier where a call must come behind it: before `send/3', `multicast/3', `send_many/1',
%% `publish/2,3', `call/2,3', `flush/0,1,2' and a nested `batch/1', and each
%% time `max_batch' calls are collected. If `Fun' raises, what was collected
%% before is sent, then the exception goes on; a process killed inside `Fun'
%% sends nothing it collected, as a loop of sends killed midway sends no more. Order per sender and receiver and
%% the counters are those of the same calls outside. A `receive' inside `Fun'
%% waiting for an answer to a message collected there waits forever: send it with
%% `flush/0' first (which sends what was collected), or outside the batch.
-spec batch(fun(() -> T)) -> T.
batch(Fun) ->
    convoy_route:batch(Fun).

%% @doc `publish(pg, Group, Msg)': publish in OTP's default `pg' scope.
-spec publish(term(), term()) -> ok.
publish(Group, Msg) ->
    publish(pg, Group, Msg).

%% @doc Send `Msg' to every member of the `pg' group `Group' in scope `Scope'. The
%% nodes of the members this node's `pg' knows get one copy each (members here
%% get a plain local send); on each of those nodes the copy goes to the group's
%% local members as that node's `pg' has them when it is delivered. Order relative
%% to the caller's other convoy messages to each member is kept. Like a loop of
%% sends over `pg:get_members/2', a member that joined on a node this node does
%% not yet know of is missed. Raises `badarg' if `Scope' is not an atom, and
%% `{badarg, {no_pg_scope, Scope}}' if no `pg' scope `Scope' runs on this node
%% (where `pg:get_members/2' answers `[]' and nothing would be delivered): OTP
%% starts the default scope `pg' only with the kernel parameter `start_pg'; an
%% application starts its own with `pg:start_link(Scope)'.
-spec publish(atom(), term(), term()) -> ok.
publish(Scope, Group, Msg) ->
    ok = convoy_route:leave(),
    convoy_publish:publish(Scope, Group, Msg).

%% @doc Wait until everything the caller handed to convoy before the call has left
%% this node (been handed to the distribution layer) or been counted as dropped.
%% Waits as long as that takes: a stalled node can hold it until the connection is
%% declared down (`net_ticktime'); `flush/2' takes a timeout.
-spec flush() -> ok.
flush() ->
    ok = flush(all, infinity).

%% @doc Like `flush/0', for messages to `Node' only.
-spec flush(node()) -> ok.
flush(Node) when is_atom(Node) ->
    ok = flush(Node, infinity);
flush(Node) ->
    erlang:error(badarg, [Node]).

%% @doc `flush/0' (`Which' = `all') or `flush/1' with a timeout in milliseconds.
-spec flush(node() | all, timeout()) -> ok | {error, timeout}.
flush(Which, Timeout) when is_atom(Which), Timeout =:= infinity;
                           is_atom(Which), is_integer(Timeout), Timeout >= 0 ->
    ok = convoy_route:leave(),
    convoy_lanes:flush(Which, Timeout);
flush(Which, Timeout) ->
    erlang:error(badarg, [Which, Timeout]).

%% @doc Settings in force, counters per remote node, nodes forgotten, lanes, rejected
%% input and credit channel waits (`convoy_channel:stats/0').
%%
%% Per node: `accepted' (messages handed to convoy for it), `messages' (handed to
%% distribution), `batches' (distribution messages sent), `dropped', `buffered'
%% (accepted but neither sent nor dropped yet), `received' (delivered here by
%% convoy's inboxes from that node; what the peer's senders sent directly to a
%% process here arrives as a plain message, counted only there, in their
%% `direct'), `direct' (sent by the sender itself, to the destination or to the
%% peer's inbox, not through its lane; an unmarked sender's even while its lane
%% is busy), `refused'
%% (`{error, overload}' returned by `send/3'), `blocked_us' (time senders waited for
%% room), `chunked' (of `direct', messages sent in pieces, see `convoy_chunk'),
%% `stalled' (waits for the node's answer that ran out: a barrier, a lane's
%% drain before a large message, a piece; see the README), `waited_us' (time
%% senders waited for such answers), `unanswered' (true from a wait that ran out
%% until the node answers again: meanwhile its senders go through their lanes),
%% `queued' and `queued_bytes' (held by convoy now, lane mailboxes included),
%% `compressed_batches' (batches the lanes sent compressed, see the `compress'
%% setting), `compressed_bytes_in' (their messages' encoded size) and
%% `compressed_bytes_out' (their compressed size), and `route'.
%% A multicast counts as one message per entry (see `convoy:multicast/2'). `lost'
%% counts messages a lane that died had been handed and had not disposed of (not
%% per node: the lane took that with it). All counters are cumulative since convoy
%% started, or since the node was last forgotten: a node that is not connected,
%% holds nothing and has had no traffic for two minutes leaves `nodes'; its final
%% counters are added to `forgotten'. While convoy does not run: `running' false,
%% no settings, nodes or lanes, every kind of rejected input 0, `lost' 0, and the
%% forgotten nodes and channel waits as they are.
-spec info() -> info().
info() -> convoy_info:report().

%% @doc Change settings at run time; keys as in `options()'. Nothing is lost or
%% reordered, including when `lanes' changes (the number of inboxes stays as it was
%% when convoy started). Returns `{error, Reason}': `Reason' a
%% `convoy_config:error()' naming the bad key or value, `{busy, lanes}' while a
%% change of `lanes' is still draining, or `not_started' when convoy does not run.
-spec set_config(options_in()) ->
          ok | {error, convoy_config:error() | {busy, lanes} | not_started}.
set_config(Opts) ->
    convoy_control:set_config(Opts).

%% @doc Every setting: its key, default and accepted values (an atom, or
%% `{integer, Min, Max}' with `Max' possibly `unbounded'), in README order.
-spec settings() -> [{atom(), term(), convoy_config:accepts()}].
settings() ->
    convoy_config:settings().

%% @doc A child specification to run convoy in your own supervision tree, with
%% settings `Opts' (over the defaults; the application environment is not read).
%% Run convoy either this way or as an application on a node, not both: with
%% convoy among a release's applications, have it loaded only (relx
%% `{convoy, load}', a Mix release's `applications: [convoy: :load]'). Bad
%% settings raise `{badarg, Reason}' (`convoy_config:error()') here, where they are
%% written, rather than when the supervisor starts.
-spec child_spec(options_in()) -> supervisor:child_spec().
child_spec(Opts) ->
    case convoy_config:validate(Opts) of
        {ok, _} -> #{id => convoy, start => {?MODULE, start_link, [Opts]}, type => supervisor};
        {error, Reason} -> erlang:error({badarg, Reason}, [Opts])
    end.

%% @doc Start convoy's supervision tree with settings `Opts' (over the defaults;
%% the application environment is not read). Bad settings return
%% `{error, {convoy_config, Reason}}'.
-spec start_link(options_in()) -> {ok, pid()} | {error, {convoy_config, convoy_config:error()} | term()}.
start_link(Opts) ->
    case convoy_config:validate(Opts) of
        {ok, Config} -> convoy_sup:start_link(Config);
        {error, Reason} -> {error, {convoy_config, Reason}}
    end.
