%% @private
%% Each node's lanes, as senders find them and wait for them, from the runtime
%% `convoy_control' publishes for each node it has started lanes for
%% (`convoy_runtimes'). A process always uses the same lane of a node: the one
%% at `phash2(self(), lanes)' among them.
-module(convoy_lanes).

-export([runtime/2, prober/2, lane_of/1, lane/1, flush/2]).

-include("convoy_runtime.hrl").

-compile({inline, [lane_of/1]}).

%% @doc `Node''s runtime with the options of `RT' (a call's), its lanes started
%% if it had none; if convoy stopped or is stopping meanwhile, the runtime
%% published then.
-spec runtime(#runtime{}, node()) -> #runtime{} | undefined.
runtime(RT = #runtime{overload = O, block_timeout = T, refuse = R}, Node) ->
    case convoy_runtimes:row(Node) of
        Row = #runtime{overload = O, block_timeout = T, refuse = R} ->
            Row;
        Row = #runtime{} ->
            Row#runtime{overload = O, block_timeout = T, refuse = R};
        undefined ->
            ok = convoy_control:lanes_for(Node),
            case {convoy_runtimes:row(Node), persistent_term:get(?RUNTIME_KEY, undefined)} of
                {undefined, #runtime{stopping = false}} ->
                    %% convoy_control is not there to start them: restarting
                    %% (its start publishes a new runtime), or gone with
                    %% convoy's tree (what is left published is not served)
                    case whereis(convoy_control) of
                        undefined -> undefined;
                        _ -> erlang:yield(), runtime(RT, Node)
                    end;
                {undefined, StoppingOrStopped} ->
                    StoppingOrStopped;
                {_Row, _RT} ->
                    runtime(RT, Node)
            end
    end.

%% @doc `Node''s runtime and the caller's lane there, which probes the node if a
%% wait for it runs out; with convoy not running, or stopping with no lane for
%% the node, nothing probes it (`none').
-spec prober(#runtime{} | undefined, node()) -> {#runtime{} | undefined, pos_integer() | none}.
prober(undefined, _Node) ->
    {undefined, none};
prober(RT = #runtime{stopping = true}, Node) ->
    case convoy_runtimes:row(Node) of
        undefined -> {RT, none};
        Row -> {Row, lane_of(Row)}
    end;
prober(RT, Node) ->
    case runtime(RT, Node) of
        Row = #runtime{stopping = false} -> {Row, lane_of(Row)};
        StoppingOrStopped -> prober(StoppingOrStopped, Node)
    end.

%% @doc The calling process's lane among a node's (an index into its runtime's
%% `lanes').
-spec lane_of(#runtime{}) -> pos_integer().
lane_of(#runtime{n = 1}) -> 1;
lane_of(#runtime{n = N}) -> erlang:phash2(self(), N) + 1.

%% @doc The calling process's lane of a node's runtime, its pid.
-spec lane(#runtime{}) -> pid().
lane(Row = #runtime{lanes = Lanes}) ->
    element(lane_of(Row), Lanes).

%% @doc `convoy:flush/2', in the caller: wait until the caller's lane for `Which'
%% (a node, or every node with lanes: `all') has shipped or counted as dropped
%% everything the caller handed it. With convoy stopping, wait for the lane to
%% finish instead (bounded by the stop); with convoy not running, or for this
%% node, nothing waits.
-spec flush(node() | all, timeout()) -> ok | {error, timeout}.
flush(Which, Timeout) ->
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        undefined ->
            ok;
        _ when Which =:= node() ->
            ok;
        _RT ->
            {Stopping, Running} = lists:partition(fun({_, #runtime{stopping = S}, _}) -> S end,
                                                  callers_lanes(Which)),
            %% A stopping lane ships everything and goes (the stop bounds the wait).
            lists:foreach(fun({_, _, Lane}) -> ok = convoy_wait:await_gone(Lane) end, Stopping),
            case convoy_wait:flush([{Node, Lane} || {Node, _, Lane} <- Running], Timeout) of
                ok -> ok;
                down -> flush(Which, Timeout); % a lane was replaced, or convoy restarted
                timeout -> {error, timeout}
            end
    end.

%% The caller's lane for each node `Which' names: its runtime and its pid.
callers_lanes(all) ->
    lists:append([callers_lanes(Node) || Node <- convoy_control:lane_nodes()]);
callers_lanes(Node) ->
    case convoy_runtimes:row(Node) of
        undefined -> []; % no lane of its has taken anything
        Row -> [{Node, Row, lane(Row)}]
    end.
