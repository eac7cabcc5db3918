%% @private
%% Which connected nodes run a compatible convoy, and the per-node table.
%%
%% == The table ==
%% This process owns the `convoy_nodes' table (protected) and is its only writer:
%% one row per remote node convoy has dealt with, `{Node, Route, Counters, Held}'
%% (see `convoy_metrics'), where `Route' is `{convoy, Version, InboxNames}' for a
%% peer that answered our hello with a version we share, and `plain' for every other
%% node (no convoy, an incompatible one, not yet answered, or gone). Nobody else
%% pattern-matches rows: readers use `route/1', `known_route/1', `lookup/1',
%% `convoy_nodes/0' and `all/0' (straight from ETS, no call), and `refs/1', which
%% creates a missing row with a call here.
%%
%% == The exchange ==
%% What we learn about node X comes only from X's answer to our own request:
%% <ol>
%% <li>To ask X (on start-up for every connected node, on nodeup, and when a hello
%%   claiming X arrives), this process makes a fresh alias R, monitors
%%   `{convoy_peers, X}' and sends it `hello' with `request => R'. At most one
%%   request per node is outstanding: asking again meanwhile only marks it to be
%%   repeated once it ends. A request ends with its welcome, when the monitor fires
%%   (at once if X runs no convoy_peers: a node without convoy holds no request) or
%%   after `REQUEST_TIMEOUT'.</li>
%% <li>A hello claiming X (X connected; the hello valid, see `convoy_wire') is
%%   answered with our `welcome' sent to its `request' alias, carrying that alias
%%   back as `request' (once per alias: a replayed hello is not answered again).
%%   Then we ask X ourselves, unless the hello names the `peers' pid we already
%%   learnt for X. Nothing in a hello is learnt: it may be forged or replayed by
%%   any connected node.</li>
%% <li>A welcome is learnt from only if its `request' is the alias of our
%%   outstanding request to the node it names; then the alias is dropped (a
%%   replayed welcome is no longer addressed to anything). Any other welcome is
%%   rejected as `unsolicited'. A welcome sent by a release that predates
%%   `request' is rejected the same way: that node stays `plain' for us (never
%%   wrongly `convoy'), while it still learns us from our hello.</li>
%% <li>Learning is idempotent: the same route and the same peer again change
%%   nothing, and a new route replaces the old one in place, never through
%%   `plain'. A welcome with no version in common makes the node `plain' (counted
%%   as `bad_version').</li>
%% </ol>
%% The learnt peer's convoy_peers is monitored: when it stops (or the connection
%% goes), its node goes back to `plain'; when it starts again it says hello and we
%% ask. A node without convoy never answers and stays `plain'.
%%
%% Never suspended by a connection: this process answers and asks every node,
%% and `refs/1' (a sender's, an inbox's first batch from a node) waits for it.
%% Hellos and welcomes go through `convoy_remote:send/3' (a courier waits out a
%% busy connection), and each monitor of another node's process is a watcher's
%% (`convoy_remote:watch/2'), dropped by killing it: none of them waits for a
%% stalled node's full connection.
%%
%% Untrusted input: `nodeup' and `nodedown' are acted on only when the node's
%% current state agrees (connected, not connected); acting on them is safe either
%% way, so they are not counted. A `DOWN' for a monitor we do not hold, a timer
%% message that is not our running timer, a call from another node and any stray
%% term are counted as rejected (`unknown_message'); nothing changes state.
%%
%% == Forgetting nodes ==
%% Every `SWEEP_INTERVAL' this process forgets rows whose node is not connected,
%% that holds nothing (`convoy_held:is_empty/1') and whose counters have not
%% changed for `GRACE'.
%% Invalidation contract for holders of a row's `{Counters, Held}': this process
%% deletes a row only once `convoy_held:try_close/1' closed its held array for good
%% (nothing held), and then marks its counters (`convoy_metrics:close/1'); a
%% holder whose `convoy_held:hold/4' or `convoy_metrics:add_direct/1' returns
%% `closed' fetches the refs again (`refs/1'). The
%% final counters of forgotten nodes are logged (one report per sweep) and kept in
%% a bounded history (`forgotten/0', shown by `convoy:info/0').
%%
%% For tests (and operators): `set_sweep/1' changes the interval and the grace of
%% the running process (not kept across restarts), `sweep/0' sweeps at once.
-module(convoy_peers).
-behaviour(gen_server).

-export([start_link/1, route/1, known_route/1, lookup/1, convoy_nodes/0, all/0, refs/1,
         forgotten/0, set_sweep/1, sweep/0]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2]).

-export_type([route/0, history/0]).

-include_lib("kernel/include/logger.hrl").
-include("convoy_tags.hrl").

-define(TABLE, convoy_nodes).
%% A row's counters and held array are also published in persistent_term under
%% `{?REFS, Node}' while the row exists: a sender reads them there without
%% copying them out of ETS (a copy of each reference bumps a count every sender
%% shares, and a fresh process pays that on its first send). Put once when the
%% row is made, erased when it is forgotten (a global GC, at most once per node
%% per sweep) and at start for a previous instance's rows.
-define(REFS, convoy_node_refs).

%% A row is forgotten once its node has been gone, holding nothing, with its
%% counters unchanged, for GRACE: two minutes outlasts a net_ticktime (60 s by
%% default) disconnection and a quick reconnect, so a flapping node keeps its
%% counters, while a burst of sends to dead names is cleaned up within
%% GRACE + SWEEP_INTERVAL. A sweep reads every row (a few microseconds each), so
%% every 30 s costs nothing noticeable even with tens of thousands of rows.
-define(SWEEP_INTERVAL, 30000).
-define(GRACE, 120000).
%% A request not answered within this long ends (a node without convoy never
%% answers); one marked to be repeated is sent again then. Checked every TICK.
-define(REQUEST_TIMEOUT, 10000).
-define(TICK, 5000).
%% Forgotten nodes kept one by one in the history and named in a sweep's report.
-define(HISTORY, 16).
%% How long refs/1 and forgotten/0 wait for this process.
-define(CALL_TIMEOUT, 5000).

-type route() :: plain | {convoy, pos_integer(), tuple()}.
-type counts() :: #{convoy_metrics:counter() => non_neg_integer()}.
-type history() :: #{nodes := non_neg_integer(),
                     totals := counts(),
                     last := [#{node := node(), at := integer(), counters := counts()}]}.

-record(req, {alias :: reference(),
              watch :: convoy_remote:watch(),   % of {convoy_peers, Node}
              since :: integer(),
              again = false :: boolean()}).

-record(s, {inboxes :: pos_integer(),
            %% learnt peers: their convoy_peers and our watch of it
            peers = #{} :: #{node() => {pid(), convoy_remote:watch()}},
            %% the monitors of our watches of learnt peers and of requests'
            %% addressees (a watch's DOWN is that of its monitor)
            mons = #{} :: #{reference() => {peer | request, node()}},
            %% hellos and welcomes waiting for a busy connection
            out = convoy_remote:new() :: convoy_remote:outbox(),
            requests = #{} :: #{node() => #req{}},
            %% the last hello request answered, per node
            answered = #{} :: #{node() => reference()},
            interval = ?SWEEP_INTERVAL :: pos_integer(),
            grace = ?GRACE :: non_neg_integer(),
            next_sweep :: integer(),
            tick :: reference() | undefined,
            %% rows of nodes not connected: counter total and since when unchanged
            seen = #{} :: #{node() => {non_neg_integer(), integer()}},
            history :: history()}).

-spec start_link(pos_integer()) -> {ok, pid()} | {error, term()}.
start_link(Inboxes) ->
    gen_server:start_link({local, ?MODULE}, ?MODULE, Inboxes, []).

%% @doc The current route to `Node' (`plain' when convoy is not running).
-spec route(node()) -> route().
route(Node) ->
    case lookup(Node) of
        {Route, _C, _H} -> Route;
        none -> plain
    end.

%% @doc The current route to `Node', or `unknown' when the table is gone (convoy
%% is not running, or its tree is being torn down): a caller that knew a route
%% may keep it (`convoy_lane' while it drains). Read from ETS.
-spec known_route(node()) -> route() | unknown.
known_route(Node) ->
    try ets:lookup(?TABLE, Node) of
        [{_, Route, _C, _H}] -> Route;
        [] -> plain
    catch
        error:badarg -> unknown
    end.

%% @doc `Node''s row: route, counters and held atomics; `none' if it has no row
%% (or convoy is not running). Read from ETS.
-spec lookup(node()) -> {route(), counters:counters_ref(), convoy_held:held()} | none.
lookup(Node) ->
    try ets:lookup(?TABLE, Node) of
        [{_, Route, C, H}] -> {Route, C, H};
        [] -> none
    catch
        error:badarg -> none
    end.

%% @doc Nodes routed to through convoy now. Read from ETS.
-spec convoy_nodes() -> [node()].
convoy_nodes() ->
    try
        ets:select(?TABLE, [{{'$1', {convoy, '_', '_'}, '_', '_'}, [], ['$1']}])
    catch
        error:badarg -> []
    end.

%% @doc Every row, as `{Node, {Route, Counters, Held}}'. Read from ETS.
-spec all() -> [{node(), {route(), counters:counters_ref(), convoy_held:held()}}].
all() ->
    try
        ets:select(?TABLE, [{{'$1', '$2', '$3', '$4'}, [], [{{'$1', {{'$2', '$3', '$4'}}}}]}])
    catch
        error:badarg -> []
    end.

%% @doc `Node''s counters and held atomics; the row is created (by this process)
%% if missing. `undefined' if this process is not running or does not answer within
%% `CALL_TIMEOUT': never raises, as the caller may be a user's process.
-spec refs(node()) -> {counters:counters_ref(), convoy_held:held()} | undefined.
refs(Node) when is_atom(Node) ->
    case persistent_term:get({?REFS, Node}, none) of
        {_C, _H} = Refs ->
            Refs;
        none ->
            try
                gen_server:call(?MODULE, {refs, Node}, ?CALL_TIMEOUT)
            catch
                exit:_ -> undefined
            end
    end.

%% @doc Nodes forgotten since convoy started: how many, their counters' totals, and
%% the last `HISTORY' of them (newest first, `at' in system time milliseconds).
%% Empty when convoy is not running.
-spec forgotten() -> history().
forgotten() ->
    try
        gen_server:call(?MODULE, forgotten, ?CALL_TIMEOUT)
    catch
        exit:_ -> empty_history()
    end.

%% @doc Change the sweep interval and grace (milliseconds) of the running process;
%% the new interval applies from the next sweep. Meant for tests.
-spec set_sweep(#{interval := pos_integer(), grace := non_neg_integer()}) -> ok.
set_sweep(#{interval := I, grace := G} = Opts) when is_integer(I), I > 0, is_integer(G), G >= 0 ->
    ok = gen_server:call(?MODULE, {set_sweep, maps:with([interval, grace], Opts)});
set_sweep(Opts) ->
    erlang:error(badarg, [Opts]).

%% @doc Sweep now; returns how many nodes were forgotten.
-spec sweep() -> non_neg_integer().
sweep() ->
    gen_server:call(?MODULE, sweep).

%% @private
-spec init(pos_integer()) -> {ok, #s{}}.
init(Inboxes) ->
    _ = ets:new(?TABLE, [named_table, protected, set, {read_concurrency, true}]),
    _ = [persistent_term:erase(K) || {{?REFS, _} = K, _} <- persistent_term:get()],
    ok = net_kernel:monitor_nodes(true, [{node_type, all}]),
    S = tick(#s{inboxes = Inboxes, history = empty_history(),
                next_sweep = now_ms() + ?SWEEP_INTERVAL}),
    {ok, lists:foldl(fun ask/2, S, nodes(connected))}.

%% @private
-spec handle_call(term(), gen_server:from(), #s{}) -> {reply, term(), #s{}}.
handle_call(Req, {Pid, _Tag}, S) when node(Pid) =:= node() ->
    local_call(Req, S);
handle_call(_Req, _From, S) ->
    unknown_call(S).

local_call({refs, Node}, S) when is_atom(Node) ->
    {reply, ensure_row(Node), S};
local_call(forgotten, S) ->
    {reply, S#s.history, S};
local_call({set_sweep, #{interval := I, grace := G}}, S)
  when is_integer(I), I > 0, is_integer(G), G >= 0 ->
    {reply, ok, S#s{interval = I, grace = G, next_sweep = min(S#s.next_sweep, now_ms() + I)}};
local_call(sweep, S) ->
    {N, S1} = do_sweep(S),
    {reply, N, S1};
local_call(_Req, S) ->
    unknown_call(S).

unknown_call(S) ->
    convoy_metrics:rejected(unknown_message),
    {reply, {error, unknown_call}, S}.

%% @private
-spec handle_cast(term(), #s{}) -> {noreply, #s{}}.
handle_cast(_Msg, S) ->
    rejected(unknown_message, S).

%% @private
-spec handle_info(term(), #s{}) -> {noreply, #s{}}.
handle_info({nodeup, Node, _Info}, S) when is_atom(Node) ->
    %% Forged or real, asking is safe (ask/2 checks the node is connected).
    {noreply, ask(Node, S)};
handle_info({nodedown, Node, _Info}, S) when is_atom(Node) ->
    case connected(Node) of
        %% Forged, or from before a reconnection: the monitor tells the rest.
        true -> {noreply, S};
        false -> {noreply, gone(Node, S)}
    end;
handle_info({'DOWN', Ref, process, _Pid, _Reason}, S = #s{mons = M}) ->
    case M of
        #{Ref := {peer, Node}} ->
            {noreply, forget(Node, S)};
        #{Ref := {request, Node}} ->
            %% Nobody to answer (yet): ask again only if asked to meanwhile.
            R = maps:get(Node, S#s.requests),
            {noreply, again(Node, R, end_request(Node, R, S))};
        %% Monitors are dropped with [flush]: a DOWN we do not hold is not real.
        _ -> rejected(unknown_message, S)
    end;
handle_info({{?TAG_COURIER, Node}, Mon, process, _Pid, _Reason}, S) when is_reference(Mon) ->
    case convoy_remote:courier_done(Node, Mon, S#s.out) of
        {ok, Out} -> {noreply, S#s{out = Out}};
        unknown -> rejected(unknown_message, S)
    end;
handle_info({timeout, TRef, tick}, S = #s{tick = TRef}) ->
    {noreply, tick(on_tick(S))};
handle_info(Msg, S) ->
    wire(convoy_wire:decode(Msg), S).

wire({hello, #{node := Node} = Info}, S) ->
    case connected(Node) of
        true -> {noreply, hello(Node, Info, S)};
        false -> rejected(unknown_node, S)
    end;
wire({welcome, #{node := Node} = Info}, S = #s{requests = Rs}) ->
    case {Rs, Info} of
        {#{Node := R = #req{alias = Ref}}, #{request := Ref}} ->
            {noreply, welcome(Node, R, Info, S)};
        _ ->
            rejected(unsolicited, S)
    end;
wire({error, Kind}, S) ->
    rejected(Kind, S);
wire({Batch, _, _, _}, S) when Batch =:= batch; Batch =:= zbatch ->
    rejected(unknown_message, S).

rejected(Kind, S) ->
    convoy_metrics:rejected(Kind),
    {noreply, S}.

%%--------------------------------------------------------------------
%% The exchange

%% A hello claiming Node: answer it, then ask Node ourselves unless it names the
%% peer we know.
hello(Node, Info = #{peers := Pid}, S) ->
    S1 = answer(Node, Info, S),
    case S1#s.peers of
        #{Node := {Pid, _}} -> S1;
        _ -> ask(Node, S1)
    end.

answer(Node, #{request := Ref}, S = #s{answered = A}) ->
    case A of
        #{Node := Ref} ->
            S;
        _ ->
            S1 = say(welcome, Ref, Ref, S),
            S1#s{answered = A#{Node => Ref}}
    end;
answer(_Node, _OlderRelease, S) ->
    %% A release without requests: it learns us from our own hello.
    S.

ask(Node, S = #s{requests = Rs}) ->
    case Rs of
        #{Node := R} ->
            S#s{requests = Rs#{Node := R#req{again = true}}};
        _ ->
            case connected(Node) of
                true ->
                    Alias = alias(),
                    {_, Mon} = Watch = convoy_remote:watch({?MODULE, Node}, 'DOWN'),
                    S1 = say(hello, {?MODULE, Node}, Alias, S),
                    S1#s{requests = Rs#{Node => #req{alias = Alias, watch = Watch,
                                                     since = now_ms()}},
                         mons = (S1#s.mons)#{Mon => {request, Node}}};
                false ->
                    S
            end
    end.

say(Kind, To, Request, S = #s{inboxes = I}) ->
    Info = #{versions => convoy_wire:versions(), node => node(), peers => self(),
             inboxes => I, request => Request},
    S#s{out = convoy_remote:send(To, convoy_wire:hello(Kind, Info), S#s.out)}.

%% The answer to our request to Node.
welcome(Node, R, Info, S) ->
    S1 = end_request(Node, R, S),
    S2 = case connected(Node) of
             true -> learn(Node, Info, S1);
             false -> S1 % it left meanwhile
         end,
    again(Node, R, S2).

end_request(Node, #req{alias = Alias, watch = {_, Mon} = Watch}, S) ->
    _ = unalias(Alias),
    ok = convoy_remote:unwatch(Watch),
    S#s{requests = maps:remove(Node, S#s.requests), mons = maps:remove(Mon, S#s.mons)}.

again(Node, #req{again = true}, S) -> ask(Node, S);
again(_Node, #req{again = false}, S) -> S.

learn(Node, #{versions := Vsns, peers := Pid, inboxes := N}, S) ->
    case convoy_wire:negotiate(Vsns) of
        none ->
            %% Their convoy speaks no version we know: plain sends, as for no convoy.
            convoy_metrics:rejected(bad_version),
            forget(Node, S);
        Vsn ->
            S1 = watch(Node, Pid, S),
            set_route(Node, {convoy, Vsn, convoy_wire:inbox_names(N)}),
            S1
    end.

watch(Node, Pid, S = #s{peers = P}) ->
    case P of
        #{Node := {Pid, _}} ->
            S;
        _ ->
            S1 = unwatch(Node, S),
            {_, Mon} = Watch = convoy_remote:watch(Pid, 'DOWN'),
            S1#s{peers = (S1#s.peers)#{Node => {Pid, Watch}},
                 mons = (S1#s.mons)#{Mon => {peer, Node}}}
    end.

unwatch(Node, S = #s{peers = P, mons = M}) ->
    case P of
        #{Node := {_, {_, Mon} = Watch}} ->
            ok = convoy_remote:unwatch(Watch),
            S#s{peers = maps:remove(Node, P), mons = maps:remove(Mon, M)};
        _ ->
            S
    end.

%% Node's convoy is gone (or speaks no version we know): plain sends.
forget(Node, S) ->
    set_route(Node, plain),
    unwatch(Node, S).

%% Node is not connected: drop everything about it but its row.
gone(Node, S = #s{requests = Rs}) ->
    S1 = case Rs of
             #{Node := R} -> end_request(Node, R, S);
             _ -> S
         end,
    forget(Node, S1#s{answered = maps:remove(Node, S1#s.answered)}).

%% Same route again: nothing changes. A new one replaces the old in place.
set_route(Node, Route) ->
    case ets:lookup(?TABLE, Node) of
        [{_, Route, _, _}] ->
            ok;
        [_] ->
            true = ets:update_element(?TABLE, Node, {2, Route}),
            ok;
        [] when Route =:= plain ->
            ok;
        [] ->
            _ = new_row(Node, Route),
            ok
    end.

ensure_row(Node) ->
    case ets:lookup(?TABLE, Node) of
        [{_, _, C, H}] ->
            {C, H};
        [] ->
            new_row(Node, plain)
    end.

new_row(Node, Route) ->
    {C, H} = convoy_metrics:new_refs(),
    true = ets:insert(?TABLE, {Node, Route, C, H}),
    ok = persistent_term:put({?REFS, Node}, {C, H}),
    {C, H}.

connected(Node) ->
    lists:member(Node, nodes(connected)).

now_ms() ->
    erlang:monotonic_time(millisecond).

%%--------------------------------------------------------------------
%% The tick: requests that time out, and the sweep when due

tick(S = #s{interval = I}) ->
    S#s{tick = erlang:start_timer(min(?TICK, I), self(), tick)}.

on_tick(S0) ->
    Now = now_ms(),
    S1 = maps:fold(fun(Node, R = #req{since = T}, Acc) when Now - T >= ?REQUEST_TIMEOUT ->
                           again(Node, R, end_request(Node, R, Acc));
                      (_Node, _R, Acc) ->
                           Acc
                   end, S0, S0#s.requests),
    case Now >= S1#s.next_sweep of
        true -> element(2, do_sweep(S1));
        false -> S1
    end.

%%--------------------------------------------------------------------
%% The sweep

do_sweep(S = #s{grace = Grace, seen = Seen0}) ->
    Now = now_ms(),
    Connected = maps:from_keys(nodes(connected), true),
    {Seen, Due} =
        ets:foldl(fun({Node, _Route, C, H}, {SeenAcc, DueAcc}) ->
                          case is_map_key(Node, Connected) of
                              true -> {SeenAcc, DueAcc};
                              false -> observe(Node, C, H, Now, Grace, Seen0, SeenAcc, DueAcc)
                          end
                  end, {#{}, []}, ?TABLE),
    {Forgotten, S1} = lists:foldl(fun(Row, Acc) -> close(Row, Now, Acc) end,
                                  {[], S#s{seen = Seen}}, Due),
    S2 = S1#s{next_sweep = Now + S1#s.interval},
    case Forgotten of
        [] ->
            {0, S2};
        _ ->
            report(Forgotten),
            {length(Forgotten), S2#s{history = remember(Forgotten, S2#s.history)}}
    end.

observe(Node, C, H, Now, Grace, Seen0, Seen, Due) ->
    Total = lists:sum(maps:values(convoy_metrics:node_info(C))),
    Idle = convoy_held:is_empty(H),
    case Seen0 of
        #{Node := {Total, Since}} when Idle, Now - Since >= Grace ->
            {Seen, [{Node, C, H, Total} | Due]};
        #{Node := {Total, Since}} when Idle ->
            {Seen#{Node => {Total, Since}}, Due};
        _ ->
            {Seen#{Node => {Total, Now}}, Due}
    end.

%% Close the row's held array and delete the row, unless a sender got in first.
close({Node, C, H, Total}, Now, {Forgotten, S}) ->
    case convoy_held:try_close(H) of
        true ->
            ok = convoy_metrics:close(C),
            true = ets:delete(?TABLE, Node),
            _ = persistent_term:erase({?REFS, Node}),
            ok = lanes_go(Node),
            S1 = gone(Node, S),
            {[{Node, convoy_metrics:node_counts(C)} | Forgotten],
             S1#s{seen = maps:remove(Node, S1#s.seen)}};
        false ->
            {Forgotten, S#s{seen = (S#s.seen)#{Node => {Total, Now}}}}
    end.

%% The node's lanes go too: convoy_control retires them once it finds the node
%% gone. A message, not a call: this process never waits on the lanes' owner.
lanes_go(Node) ->
    case whereis(convoy_control) of
        undefined -> ok;
        Control -> Control ! {?TAG_FORGOTTEN, Node}, ok
    end.

report(Forgotten) ->
    {Named, Rest} = lists:split(min(?HISTORY, length(Forgotten)), Forgotten),
    ?LOG_NOTICE(#{what => convoy_nodes_forgotten, count => length(Forgotten),
                  totals => totals(Forgotten, #{}), nodes => maps:from_list(Named),
                  not_named => length(Rest),
                  note => "nodes gone and idle; their final counters, no longer in convoy:info()"}).

empty_history() ->
    #{nodes => 0, totals => #{}, last => []}.

remember(Forgotten, #{nodes := N, totals := T, last := Last}) ->
    At = erlang:system_time(millisecond),
    New = [#{node => Node, at => At, counters => Cs}
           || {Node, Cs} <- lists:sublist(Forgotten, ?HISTORY)],
    #{nodes => N + length(Forgotten), totals => totals(Forgotten, T),
      last => lists:sublist(New ++ Last, ?HISTORY)}.

totals(Forgotten, T0) ->
    lists:foldl(fun({_Node, Cs}, T) ->
                        maps:fold(fun(K, V, Acc) -> Acc#{K => V + maps:get(K, Acc, 0)} end, T, Cs)
                end, T0, Forgotten).
