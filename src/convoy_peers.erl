%% @private
%% Which connected nodes run a compatible convoy.
%%
%% Owns the `convoy_nodes' table: one row per remote node convoy has dealt with,
%% `{Node, Route, Counters, Held}' (see convoy_metrics), where `Route' is `{convoy, Version, InboxNames}' for a
%% peer that answered our hello with a version we share, and `plain' for every other
%% node (no convoy, an incompatible one, not yet answered, or gone). Senders and lanes
%% read it directly; only this process changes routes.
%%
%% Protocol (see `convoy_wire'): on start-up and on every nodeup this process sends
%% `hello' to `{convoy_peers, Node}'; a `hello' is answered with `welcome'. A node
%% without convoy never answers and stays `plain'. A peer's convoy_peers is
%% monitored: when it stops, its node goes back to `plain'; when it starts again it
%% says hello itself.
-module(convoy_peers).
-behaviour(gen_server).

-export([start_link/1, route/1]).
-export([init/1, handle_call/3, handle_cast/2, handle_info/2]).

-define(TABLE, convoy_nodes).

-record(s, {inboxes :: pos_integer(),
            monitors = #{} :: #{node() => reference()}}).

-spec start_link(pos_integer()) -> {ok, pid()} | {error, term()}.
start_link(Inboxes) ->
    gen_server:start_link({local, ?MODULE}, ?MODULE, Inboxes, []).

%% @doc The current route to `Node'.
-spec route(node()) -> plain | {convoy, pos_integer(), tuple()}.
route(Node) ->
    case ets:lookup(?TABLE, Node) of
        [{_, Route, _, _}] -> Route;
        [] -> plain
    end.

%% @private
-spec init(pos_integer()) -> {ok, #s{}}.
init(Inboxes) ->
    _ = ets:new(?TABLE, [named_table, public, set, {read_concurrency, true},
                         {write_concurrency, true}]),
    ok = net_kernel:monitor_nodes(true, [{node_type, all}]),
    S = #s{inboxes = Inboxes},
    [say(hello, N, S) || N <- nodes(connected)],
    {ok, S}.

%% @private
-spec handle_call(term(), gen_server:from(), #s{}) -> {reply, {error, unknown_call}, #s{}}.
handle_call(_Req, _From, S) ->
    convoy_metrics:rejected(unknown_message),
    {reply, {error, unknown_call}, S}.

%% @private
-spec handle_cast(term(), #s{}) -> {noreply, #s{}}.
handle_cast(_Msg, S) ->
    convoy_metrics:rejected(unknown_message),
    {noreply, S}.

%% @private
-spec handle_info(term(), #s{}) -> {noreply, #s{}}.
handle_info({nodeup, Node, _Info}, S) when is_atom(Node) ->
    say(hello, Node, S),
    {noreply, S};
handle_info({nodedown, Node, _Info}, S) when is_atom(Node) ->
    %% Trusted only if the node is really gone (anyone can send this tuple).
    case lists:member(Node, nodes(connected)) of
        true -> {noreply, S};
        false -> {noreply, forget(Node, S)}
    end;
handle_info({'DOWN', Ref, process, _, _}, S = #s{monitors = M}) ->
    case [N || {N, R} <- maps:to_list(M), R =:= Ref] of
        [Node] -> {noreply, forget(Node, S)};
        [] -> {noreply, S}
    end;
handle_info(Msg, S) ->
    case convoy_wire:decode(Msg) of
        {Kind, #{node := Node} = Info} when Kind =:= hello; Kind =:= welcome ->
            case lists:member(Node, nodes(connected)) of
                true ->
                    Kind =:= hello andalso say(welcome, Node, S),
                    {noreply, learn(Node, Info, S)};
                false ->
                    convoy_metrics:rejected(unknown_node),
                    {noreply, S}
            end;
        {error, Kind} ->
            convoy_metrics:rejected(Kind),
            {noreply, S};
        {batch, _, _, _} ->
            convoy_metrics:rejected(unknown_message),
            {noreply, S}
    end.

say(Kind, Node, #s{inboxes = I}) ->
    Info = #{versions => convoy_wire:versions(), node => node(), peers => self(),
             inboxes => I},
    _ = erlang:send({?MODULE, Node}, convoy_wire:hello(Kind, Info), [noconnect]),
    ok.

learn(Node, #{versions := Vsns, peers := Pid, inboxes := N}, S) ->
    S1 = forget(Node, S),
    case convoy_wire:negotiate(Vsns) of
        none ->
            %% Their convoy speaks no version we know: plain sends, as for no convoy.
            convoy_metrics:rejected(bad_version),
            S1;
        Vsn ->
            _ = convoy_metrics:node_refs(Node),
            true = ets:update_element(?TABLE, Node, {2, {convoy, Vsn, convoy_wire:inbox_names(N)}}),
            S1#s{monitors = (S1#s.monitors)#{Node => erlang:monitor(process, Pid)}}
    end.

forget(Node, S = #s{monitors = M}) ->
    case M of
        #{Node := Ref} -> erlang:demonitor(Ref, [flush]);
        _ -> ok
    end,
    _ = ets:update_element(?TABLE, Node, {2, plain}),
    S#s{monitors = maps:remove(Node, M)}.
